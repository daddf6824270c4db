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


#: the modules that take longest, run first: each worker takes a whole module at a time
#: (--dist loadfile), and a long one drawn last keeps one worker busy after the others end
_FIRST = ("test_manager.py", "test_faults.py", "test_engines.py", "test_manager_ray.py",
          "test_faults_colocated.py", "test_delta.py", "test_simulate.py", "test_sharded.py",
          "test_first_hour.py", "test_readme.py", "test_sglang_sink.py", "test_soak.py")


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # (stable: the rest as found)


_module_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0]
    _module_seconds[module] = _module_seconds.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    """Seconds per module (set-up, calls and tear-down): what to order and balance by."""
    if not _module_seconds:
        return
    top = sorted(_module_seconds.items(), key=lambda kv: -kv[1])[:12]
    terminalreporter.write_line("seconds per module: "
                                + ", ".join(f"{m.split('/')[-1]} {s:.0f}" for m, s in top))


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
