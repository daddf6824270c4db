"""weightbus's SGLang sink on CPU (SGLang itself runs only on GPUs: `tests/test_sglang_gpu.py`).

What runs here is everything of the sink that does not need SGLang: the hook SGLang calls
in each TP worker (commands, a weightbus engine hosted there, the dry run through the
model's own ``load_weights`` before a byte loads, outcomes posted to the group's store) and
the replica the manager drives, against real weightbus engines (gloo) across processes:
a trainer process, and two TP worker processes of a model with SGLang's loader conventions
(``tests/sglang_toy.py``: fused q/k/v, stacked experts, TP slices). Weights change between
updates; every TP rank's parameters are compared bitwise with what the model's own loaders
make of the trainer's tensors."""

import time

import pytest
import torch
from sglang_toy import ToyEngine, ToyModel, checkpoint

from weightbus.integrations.sglang import SGLangReplica, dry_run, engine_args
from weightbus.manager import CheckpointEngineManager, UpdateFailed
from weightbus.plan import Manifest, TensorMeta
from weightbus.runtime.group import LocalWorkerGroup, WorkerError, call
from weightbus.sources import ModuleSource
from weightbus.worker import WeightbusWorker

T = 60  # seconds, every wait


class ToyTrainer(WeightbusWorker):
    def __init__(self, rank, world):
        torch.set_num_threads(1)
        self.weights = checkpoint(0)
        self.extra = {}

    def step(self, seed):
        for k, t in checkpoint(seed).items():
            self.weights[k] = t

    def set_extra(self, extra):
        self.extra = extra

    def tensors(self):
        return dict(self.weights)

    def weights_source(self):
        return ModuleSource({**self.weights, **self.extra})


def expected(weights, rank, tp):
    model = ToyModel(rank, tp)
    model.load_weights(weights.items())
    return {n: p.detach() for n, p in model.named_parameters()}


def manifest_of(named):
    return Manifest(TensorMeta(n, t.dtype, tuple(t.shape)) for n, t in named.items())


# ------------------------------------------------------------------ the dry run


def test_dry_run_accepts_the_checkpoint_and_writes_nothing():
    model = ToyModel(1, 2)
    before = {n: p.clone() for n, p in model.named_parameters()}
    assert dry_run(model, manifest_of(checkpoint(0))) is None
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.weight_loader.__name__ != "load" if hasattr(p, "weight_loader") else True  # restored


@pytest.mark.parametrize("change, says", [
    ({"q_proj.weight": None, "qproj.weight": (8, 8)}, "takes no parameter from 1 tensor"),  # (renamed)
    ({"experts.5.up_proj.weight": (16, 8)}, "experts.5.up_proj.weight"),  # an expert the model lacks
    ({"o_proj.weight": (9, 8)}, "o_proj.weight"),  # a shape the loader refuses
    ({"norm.weight": (9,)}, "norm.weight"),
    ({"norm.weight": None}, "leaves out 1 parameter"),
    ({"experts.1.down_proj.weight": None}, "fills only part of 1 parameter"),
])
def test_dry_run_refuses_what_the_model_cannot_take(change, says):
    named = checkpoint(0)
    for name, shape in change.items():
        named.pop(name, None)
        if shape is not None:
            named[name] = torch.zeros(shape)
    why = dry_run(ToyModel(0, 2), manifest_of(named))
    assert why is not None and says in why, why


def test_dry_run_partial_allows_a_subset():
    named = {k: v for k, v in checkpoint(0).items() if k.startswith("experts.")}
    assert "leaves out" in dry_run(ToyModel(0, 2), manifest_of(named))
    assert dry_run(ToyModel(0, 2), manifest_of(named), partial=True) is None


def test_replica_is_checked_where_it_is_given(free_port):
    class Bare:
        server_args = type("A", (), {"tp_size": 1, "pp_size": 1, "dp_size": 1, "custom_weight_loader": []})
    with pytest.raises(Exception, match="custom_weight_loader"):
        SGLangReplica(Bare())
    loaders = engine_args(model_path="m", custom_weight_loader=["a.b"])["custom_weight_loader"]
    assert loaders == ["a.b", "weightbus.integrations.sglang.worker.hook"]
    one = engine_args(model_path="m", custom_weight_loader="a.b")["custom_weight_loader"]
    assert one == loaders  # (one dotted name given as a string: that name, not its characters)


# ------------------------------------------------------------------ across processes


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from weightbus.comm import free_port
    engine = ToyEngine(tp=2, port=free_port(), timeout=T)
    trainer = LocalWorkerGroup(ToyTrainer, 1, name="trainer")
    replica = SGLangReplica(engine, name="sglang0")
    mgr = CheckpointEngineManager("gloo", trainer, [replica], timeout=T, pause_mode="wait")
    yield engine, trainer, replica, mgr
    mgr.shutdown()
    trainer.shutdown()
    replica.shutdown()
    engine.shutdown()


def assert_served(engine, trainer, tp=2):
    weights = call(trainer, "tensors", timeout=T)[0]
    for r in range(tp):
        want = expected(weights, r, tp)
        got = engine.params(r)
        for n, t in want.items():
            assert torch.equal(got[n], t), (r, n)


def test_updates_land_bitwise_on_every_tp_rank(toy):
    engine, trainer, replica, mgr = toy
    flushes = engine.flushes
    for step in (1, 2, 3):
        call(trainer, "step", step, timeout=T)
        report = mgr.update_weights(version=step)
        assert report.version == step
        assert_served(engine, trainer)
        assert replica.weight_version() == step
        assert mgr.versions() == {"sglang0": step}
    assert engine.flushes - flushes == 3  # the cache of the old weights flushed with each update
    # sharded (the default for TP workers over a collective engine): each TP rank received
    # only the regions its parameters take, about half the model, every tensor placed
    whole = sum(t.numel() * t.element_size() for t in call(trainer, "tensors", timeout=T)[0].values())
    for stats in replica.last_stats:
        assert stats["fallbacks"] == 0, stats
        assert stats["bytes"] < 0.75 * whole, (stats["bytes"], whole)
    digests = replica.digests()
    assert len(digests) == 2 and set(digests[0]) == {"qkv_proj", "o_proj", "norm", "w13", "w2"}
    assert digests[0]["qkv_proj"] != digests[1]["qkv_proj"]  # each rank its own slice


@pytest.mark.parametrize("extra, says", [
    ({"model.bogus.weight": torch.ones(4, 4)}, "takes no parameter"),
    ({"o_proj.weight": torch.ones(9, 8)}, "o_proj.weight"),
])
def test_a_refused_update_keeps_weights_and_version_then_the_next_lands(toy, extra, says):
    engine, trainer, replica, mgr = toy
    call(trainer, "step", 10, timeout=T)
    v = mgr.version + 1
    mgr.update_weights(version=v)
    held = engine.params(0)
    call(trainer, "step", 11, timeout=T)
    call(trainer, "set_extra", extra, timeout=T)
    with pytest.raises(UpdateFailed, match=says) as e:
        mgr.update_weights(version=v + 1)
    assert "SGLang kept its previous weights" in str(e.value)
    assert replica.weight_version() == v and mgr.versions() == {"sglang0": v}
    for n, t in engine.params(0).items():
        assert torch.equal(t, held[n]), n  # nothing written
    call(trainer, "set_extra", {}, timeout=T)
    mgr.update_weights(version=v + 2)
    assert_served(engine, trainer)
    assert replica.weight_version() == v + 2


def test_digests_wait_with_a_deadline(toy, monkeypatch):
    """SGLang's call blocks until its scheduler answers: a scheduler that does not answer
    fails the read within the replica's deadline, naming the replica, not a hang."""
    engine, _trainer, replica, _mgr = toy
    real = engine.update_weights_from_tensor
    monkeypatch.setattr(engine, "update_weights_from_tensor",
                        lambda *a, **kw: (time.sleep(3), real(*a, **kw))[1])
    monkeypatch.setattr(replica, "_timeout", lambda: 1.0)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="sglang0.*no answer within 1s"):
        replica.digests()
    assert time.monotonic() - start < 2.5
    replica._submit("drain", lambda: None).result(10)  # (the stalled call ends before the next test)


# ------------------------------------------------------------------ faults
#
# Processes that die as an update starts (the moment the trainer builds its source: the group
# is formed, no byte has moved): the manager raises within its deadline naming who died, no
# SGLang TP worker is left waiting, served weights and version stay as they were, and the
# next update (without the dead) lands bitwise.

F = 20  # seconds: the fault tests' deadline


class FaultyTrainer(ToyTrainer):
    """A trainer that, once armed, kills a process (a replica's TP worker) or itself as the
    next update starts."""

    def __init__(self, rank, world):
        super().__init__(rank, world)
        self.armed = None

    def arm(self, pid):
        self.armed = pid

    def weights_source(self):
        import os
        import signal
        pid, self.armed = self.armed, None
        if pid == "self":
            os._exit(3)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        return super().weights_source()


def _engines(n):
    from weightbus.comm import free_port
    return [ToyEngine(tp=2, port=free_port(), timeout=T) for _ in range(n)]


def test_a_dead_tp_worker_fails_the_update_naming_its_replica_then_the_others_go_on():
    engines = _engines(2)
    trainer = LocalWorkerGroup(FaultyTrainer, 1, name="trainer")
    replicas = [SGLangReplica(e, name=f"sglang-{k}") for k, e in zip("ab", engines, strict=True)]
    mgr = CheckpointEngineManager("gloo", trainer, replicas, timeout=F, pause_mode="wait")
    try:
        call(trainer, "step", 1, timeout=T)
        mgr.update_weights(version=1)
        for e in engines:
            assert_served(e, trainer)
        held = engines[0].params(0)
        call(trainer, "step", 2, timeout=T)
        call(trainer, "arm", engines[1].workers.pids()[1], timeout=T)
        t0 = time.monotonic()
        with pytest.raises(UpdateFailed, match="sglang-b") as e:
            mgr.update_weights(version=2)
        assert time.monotonic() - t0 < 2 * F + 10, "waited past the deadline"
        msg = str(e.value)
        assert "rollout rank 3 reported no outcome" in msg, msg  # (the dead TP worker, named)
        # the healthy replica serves version 1 whole or version 2 whole, or says it is torn
        # (no version) where its update stopped after it had written a layer
        got = replicas[0].weight_version()
        if got == 2:
            assert_served(engines[0], trainer)
        elif got == 1:
            for n, t in engines[0].params(0).items():
                assert torch.equal(t, held[n]), n
        else:
            assert got is None and mgr.versions()["sglang-a"] is None and "torn" in msg, (got, msg)
        mgr.remove_replicas([replicas[1]])
        call(trainer, "step", 3, timeout=T)
        mgr.update_weights(version=3)
        assert_served(engines[0], trainer)
        assert replicas[0].weight_version() == 3 and mgr.versions() == {"sglang-a": 3}
    finally:
        mgr.shutdown()
        trainer.shutdown()
        for r in replicas:
            r.shutdown()
        for e in engines:
            e.shutdown()


def test_a_trainer_dying_as_the_update_starts_leaves_sglang_serving_then_a_new_trainer_lands():
    (engine,) = _engines(1)
    trainer = LocalWorkerGroup(FaultyTrainer, 1, name="trainer")
    replica = SGLangReplica(engine, name="sglang0", sharded=False)  # (every tensor whole)
    mgr = CheckpointEngineManager("gloo", trainer, [replica], timeout=F, pause_mode="wait")
    second = None
    try:
        mgr.update_weights(version=1)
        held = engine.params(0)
        call(trainer, "arm", "self", timeout=T)
        t0 = time.monotonic()
        with pytest.raises(UpdateFailed, match="trainer"):
            mgr.update_weights(version=2)
        assert time.monotonic() - t0 < 2 * F + 10, "waited past the deadline"
        assert replica.weight_version() == 1
        for n, t in engine.params(0).items():
            assert torch.equal(t, held[n]), n  # nothing written
        mgr.shutdown()
        trainer.shutdown()
        # a new trainer, the same SGLang engine: the next update lands whole
        second = LocalWorkerGroup(FaultyTrainer, 1, name="trainer2")
        call(second, "step", 5, timeout=T)
        mgr = CheckpointEngineManager("gloo", second, [replica], timeout=F, pause_mode="wait")
        mgr.update_weights(version=2)
        assert_served(engine, second)
        assert replica.weight_version() == 2
        whole = sum(t.numel() * t.element_size() for t in call(second, "tensors", timeout=T)[0].values())
        assert [(s["fallbacks"], s["bytes"]) for s in replica.last_stats] == [(None, whole)] * 2
    finally:
        mgr.shutdown()
        trainer.shutdown()
        if second is not None:
            second.shutdown()
        replica.shutdown()
        engine.shutdown()
