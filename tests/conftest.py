import os
import sys

import pytest
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))  # spawned workers import tests/workers.py
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
