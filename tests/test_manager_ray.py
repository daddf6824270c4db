"""CheckpointEngineManager over Ray (a local cluster shared by the module): the training
modes, replicas that register themselves, and a replica that dies mid-update. Each test
module is one unit of the suite's parallel workers: these and test_manager.py's local
ones run side by side."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import modes  # noqa: E402
from mgr_workers import ELASTIC, FailingRollout  # noqa: E402
from rl_workers import Rollout, Trainer  # noqa: E402

from weightbus import WeightbusError, WeightSyncError  # noqa: E402
from weightbus.manager import CheckpointEngineManager  # noqa: E402
from weightbus.runtime.group import call  # noqa: E402


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from weightbus.runtime.ray import ensure_ray
    ensure_ray(num_cpus=4)
    yield ray
    ray.shutdown()


def test_one_step_off_on_ray(ray_cluster):
    rows = modes.one_step_off(steps=2, ray=True)
    assert len(rows) == 2


def test_fully_async_on_ray(ray_cluster):
    out = modes.fully_async(steps=2, ray=True)
    assert out["samples"] > 0


@pytest.mark.parametrize("backend", ELASTIC or ["gloo"])  # the same manager code either way
def test_replicas_register_themselves_on_ray(ray_cluster, backend):
    """Nobody hands the manager its replicas: each rank registers itself (from its own
    constructor); the manager takes complete replicas in at its next update, drops one that
    unregisters and one that dies mid-update, and updates the rest bitwise."""
    from mgr_workers import SelfRegistering

    from weightbus.runtime.ray import RayWorkerGroup, drop_registry
    reg = f"test-{backend}-{os.getpid()}"
    trainer = RayWorkerGroup(Trainer, 1, None, name="trainer")
    # (the deadline covers Ray starting a replica's actors, 20-30 s on 2 busy cores)
    mgr = CheckpointEngineManager(backend, trainer, registry=reg, timeout=45, bucket_size=1 << 16)
    started = []

    def start(name, size, dies_at=None):  # started elsewhere: the manager never sees this handle
        started.append(RayWorkerGroup(SelfRegistering, size, name, reg, dies_at, name=f"{name}-launcher"))
        return started[-1]

    def same(group):
        want = call(trainer, "weights_digest", timeout=20)
        return call(group, "weights_digest", timeout=20) == want * group.size

    try:
        with pytest.raises(WeightbusError, match=f"none is registered in '{reg}'"):
            mgr.update_weights(version=1)
        a = start("a", 1)
        assert mgr.update_weights(version=1).replicas == ["a"] and same(a)
        b = start("b", 2)
        call(trainer, "train_step", 2, timeout=20)
        rep = mgr.update_weights(version=2)
        assert rep.replicas == ["a", "b"] and same(a) and same(b)
        if backend in ELASTIC:
            assert rep.linked == ["b"]
        call(a, "leave", timeout=20)
        call(trainer, "train_step", 3, timeout=20)
        assert mgr.update_weights(version=3).replicas == ["b"] and same(b)
        start("doomed", 1, dies_at=4)
        call(trainer, "train_step", 4, timeout=20)
        with pytest.raises(WeightSyncError, match="replica 'doomed'"):
            mgr.update_weights(version=4)
        assert [r.name for r in mgr.replicas] == ["b"]  # it died: dropped, and unregistered
        rep = mgr.update_weights(version=5)
        assert rep.replicas == ["b"] and same(b) and mgr.versions() == {"b": 5}
    finally:
        mgr.shutdown()
        for g in [trainer, *started]:
            g.shutdown()
        drop_registry(reg)


def test_ray_replica_death_is_named(ray_cluster):
    from weightbus.runtime.ray import RayWorkerGroup
    trainer = RayWorkerGroup(Trainer, 1, None, name="trainer")
    good = RayWorkerGroup(Rollout, 1, name="good")
    bad = RayWorkerGroup(FailingRollout, 1, "die", 2, name="doomed")
    mgr = CheckpointEngineManager("gloo", trainer, [good, bad], timeout=20)
    try:
        mgr.update_weights(version=1)
        call(trainer, "train_step", 2, timeout=20)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match="replica 'doomed'"):
            mgr.update_weights(version=2)
        assert time.monotonic() - t0 < 30
        mgr.remove_replicas(["doomed"])
        mgr.update_weights(version=3)
        assert mgr.versions() == {"good": 3}
        assert call(good, "weights_digest", timeout=20) == call(trainer, "weights_digest", timeout=20)
    finally:
        for g in (trainer, good, bad):
            g.shutdown()
