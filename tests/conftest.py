import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # spawned workers import tests/workers.py
os.environ.setdefault("OMP_NUM_THREADS", "1")
# workers forked from one server that imported torch once (weightbus.runtime.group): ~1 s of
# CPU less per worker, most of the suite's CPU on spawn; tests of how a command starts its
# processes (the CLI's Ctrl-C) ask for the default, spawn, themselves
os.environ.setdefault("WEIGHTBUS_START_METHOD", "forkserver")


def pytest_configure(config):
    """Without a GPU, delta mode's and the copy list's Triton kernels run under Triton's
    interpreter (tests/test_delta.py, tests/test_device_copy.py): it is chosen as Triton
    is imported, and other tests (torch's compile stack) may import it first. Only where
    those may run: the vLLM venv's own tests leave vLLM's Triton as it is."""
    triton_tests = ("test_delta", "test_device_copy")
    delta = any(os.path.isdir(a) or any(t in a for t in triton_tests) for a in config.args)
    if delta and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def port():
    """A held TCPStore server: workers rendezvous through it."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    yield store.port
    del store


@pytest.fixture
def free_port():
    """A port free right now (for a default process group's own TCP rendezvous)."""
    from weightbus.comm import free_port as port_free_now

    return port_free_now()
