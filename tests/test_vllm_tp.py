"""vLLM with tensor parallelism 2 (CPU build, one core per worker): every failure of an
update recovers, for a dense (Qwen3) and a MoE (Qwen3-MoE) model.

vLLM's multiprocess executor passes on the first worker failure of a call and leaves the
other workers' replies queued, so before weightbus stopped raising out of its workers, one
refused update left a TP=2 replica failing every later call (see
``weightbus.integrations.outcomes``). Each row of the fault matrix below ends with a
correct update whose greedy tokens equal transformers' on the trainer's weights:

- refused updates (a renamed, missing, extra, mis-shaped or wrongly typed tensor): the
  error names every worker and its cause, vLLM keeps serving the previous weights and
  version;
- one worker's loader raising after some tensors landed: the error names that worker,
  the replica reports itself torn (weight version ``none``), the next update repairs it;
- one worker slower than the deadline: the update fails at the deadline, naming it;
- a trainer process killed mid-update: vLLM generates again, and a restarted trainer
  updates it;
- ``sync_weights`` interrupted between pause and resume: the engine ends resumed;
- under ``CheckpointEngineManager``: the replica is kept, its failure reported with the
  cause, its next update succeeds; removing and re-adding it still works.

Every update here is a sharded one (a TP=2 replica gets one by default): each worker
receives only the regions its vLLM loaders keep, written in place. The sharded rows below
check that from FSDP2 trainers of 1, 2 and 3 ranks: each worker's engine counted exactly
its shard's bytes (by the rules of tensor parallelism, not weightbus's plan), nothing fell
back to whole tensors, vLLM serves transformers' tokens, and (MoE, 3 trainers: its first
layer dense, so every layer kind) every parameter equals a fresh engine's loaded from the
trainer's checkpoint; a loader swapped between updates is
recorded again (a loader that computes on its bytes gets the tensor whole, counted).
"""

import os

import pytest

vllm = pytest.importorskip("vllm")

from vllm_workers import (  # noqa: E402
    BreakingSource,
    FSDPFamilyTrainer,
    HFCheckpointTrainer,
    Trainers,
    clear_faults,
    inject_fault,
    make_family_model,
    received,
    swap_loader,
    vllm_param_digests,
)

from weightbus import UpdateFailed, WeightbusError, WeightSyncError  # noqa: E402
from weightbus.integrations.vllm import (  # noqa: E402
    OfflineLLMRollout,
    VLLMEngineReplica,
    sync_weights,
)
from weightbus.integrations.vllm.loader import KEPT  # noqa: E402
from weightbus.manager import CheckpointEngineManager  # noqa: E402
from weightbus.runtime.group import LocalWorkerGroup, call  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [100, 7, 42], [5, 300, 17]]
T = 60  # seconds, every wait
TORN = "the model is torn"


@pytest.fixture(scope="module", params=["qwen3", "qwen3-moe"])
def tp2(request, tmp_path_factory):
    """One family's tiny model in one vLLM engine at TP=2 on the native backend, shared
    by the module's tests of that family (start-up ~20 s)."""
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # (collective_rpc(functions): the faults)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    path = str(tmp_path_factory.mktemp(f"tp2-{request.param}"))
    make_family_model(path, request.param)
    llm = vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                   max_model_len=128, max_num_seqs=4, seed=0, tensor_parallel_size=2,
                   weight_transfer_config={"backend": "weightbus"})
    try:
        yield request.param, path, llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def greedy(llm, n=8):
    sp = vllm.SamplingParams(max_tokens=n, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def digests(llm):
    """Every parameter shard each worker holds (a list, one dict per worker)."""
    return llm.collective_rpc(vllm_param_digests)


def good_update(llm, tr, step):
    """A correct update after real optimizer steps: vLLM serves transformers' tokens."""
    tr.each("train_step", step)
    tr.update(step)
    assert greedy(llm) == tr.rank0.greedy(PROMPTS, 8), f"version {step}: vLLM != transformers"
    assert llm.get_weight_version() == str(step)


def test_refused_updates_recover(tp2, free_port):
    name, path, llm = tp2
    tr = Trainers(path, free_port, OfflineLLMRollout(llm), world=2, timeout=T)
    try:
        good_update(llm, tr, 1)
        hidden = tr.rank0.model.config.hidden_size
        o_proj = "model.layers.0.self_attn.o_proj.weight"
        import torch
        bad = {
            "renamed": ({o_proj: None, o_proj.replace("weight", "wieght"): torch.ones(hidden, hidden)},
                        "does not know tensor 'model.layers.0.self_attn.o_proj.wieght'"),
            "missing": ({"model.layers.1.self_attn.k_proj.weight": None}, "qkv_proj"),
            "extra": ({"model.layers.0.self_attn.extra_proj.weight": torch.ones(4, 4)}, "extra_proj"),
            "mis-shaped": ({o_proj: torch.ones(hidden, 7)}, "o_proj"),
            "wrong dtype": ({o_proj: torch.ones(hidden, hidden, dtype=torch.int32)},
                            "torch.int32 tensor cannot load into a torch.float32"),
        }
        for step, (what, (change, named)) in enumerate(bad.items(), start=2):
            served, tokens, held = digests(llm), greedy(llm), llm.get_weight_version()
            tr.each("train_step", step)  # the trainer moved on; vLLM must not see any of it
            tr.each("set_source", change)
            with pytest.raises(WeightSyncError, match=named) as err:
                tr.update(10 + step)  # (versions only go up: an older one is a rollback)
            msg = str(err.value)
            assert KEPT in msg and "rollout rank 0" in msg and "rollout rank 1" in msg, (what, msg)
            assert digests(llm) == served, f"{what}: vLLM's weights changed"
            assert greedy(llm) == tokens and llm.get_weight_version() == held, what
            tr.each("set_source")
            good_update(llm, tr, 10 + step)  # and the next correct update lands
    finally:
        tr.close()


def test_a_worker_failing_mid_load_recovers(tp2, free_port):
    """Worker 1's loader raises after 3 tensors landed: the update fails on every rank,
    the error names worker 1 and says the model is torn, its version is withdrawn; the
    next update repairs the model."""
    name, path, llm = tp2
    tr = Trainers(path, free_port, OfflineLLMRollout(llm), world=1, timeout=T)
    try:
        good_update(llm, tr, 21)
        tr.each("train_step", 22)
        llm.collective_rpc(inject_fault, args=(1, "raise", 3))
        with pytest.raises(WeightSyncError, match="rollout rank 1: .*injected loader failure") as err:
            tr.update(22)
        assert TORN in str(err.value)
        assert llm.get_weight_version() == "none"  # never a mix served under a version
        assert len(greedy(llm)[0]) == 8  # it generates (and the next update repairs it)
        good_update(llm, tr, 23)
    finally:
        llm.collective_rpc(clear_faults)
        tr.close()


def test_a_worker_slower_than_the_deadline_recovers(tp2, free_port):
    name, path, llm = tp2
    tr = Trainers(path, free_port, OfflineLLMRollout(llm), world=1, timeout=4)
    try:
        good_update(llm, tr, 31)
        tr.each("train_step", 32)
        llm.collective_rpc(inject_fault, args=(1, "slow", 7))
        with pytest.raises(WeightSyncError, match="within 4s|timed out|rollout rank 1"):
            tr.update(32)
        assert llm.get_weight_version() in ("31", "none")
        good_update(llm, tr, 33)  # a single trainer rank re-forms the group by itself
    finally:
        llm.collective_rpc(clear_faults)
        tr.close()


def test_a_trainer_killed_mid_update_recovers(tp2, free_port):
    """Trainer rank 1 dies (SIGKILL) mid-update: the survivors fail (a worker waiting on
    the dead rank, at the deadline), vLLM generates again; the restarted trainer (both
    ranks, as a job restarts) updates it."""
    from weightbus.comm import free_port as another_port
    name, path, llm = tp2
    tr = Trainers(path, free_port, OfflineLLMRollout(llm), world=2, timeout=10)
    try:
        good_update(llm, tr, 41)
        tr.each("train_step", 42)
        tr.others.submit("break_source", [(2, True)]).result(T)
        with pytest.raises(WeightSyncError):
            tr.update(42)
        assert len(greedy(llm)[0]) == 8
    finally:
        tr.rank0.shutdown()
        tr.others.shutdown()
    tr = Trainers(path, another_port(), OfflineLLMRollout(llm), world=2, timeout=T)
    try:
        good_update(llm, tr, 43)
    finally:
        tr.close()


def test_an_interrupted_sync_ends_resumed(tp2, free_port):
    """``sync_weights`` interrupted between pause and resume (a KeyboardInterrupt in the
    trainer's send): the interrupt reaches the caller, vLLM ends resumed, and the next
    update re-forms the group and lands."""
    name, path, llm = tp2
    tr = Trainers(path, free_port, OfflineLLMRollout(llm), world=1, timeout=T)
    try:
        good_update(llm, tr, 51)
        tr.each("train_step", 52)
        engine = tr.rank0.engine
        engine.source = BreakingSource(engine.source, 3, error=KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt):
            sync_weights(engine, tr.client, 52)
        assert len(greedy(llm)[0]) == 8  # resumed: it generates
        assert llm.get_weight_version() in ("51", "none")
        tr.each("set_source")
        good_update(llm, tr, 53)
    finally:
        tr.close()


def test_manager_keeps_a_failed_tp_replica(tp2):
    name, path, llm = tp2
    trainer = LocalWorkerGroup(HFCheckpointTrainer, 1, path, name="trainer")
    replica = VLLMEngineReplica(OfflineLLMRollout(llm), name="vllm0")
    mgr = CheckpointEngineManager("gloo", trainer, [replica], timeout=T, pause_mode="keep")

    def update(step):
        call(trainer, "train_step", step, timeout=T)
        mgr.update_weights(version=step)
        assert greedy(llm) == call(trainer, "greedy", PROMPTS, 8, timeout=T)[0]
        assert mgr.versions() == {"vllm0": step}

    try:
        update(61)
        call(trainer, "add_bogus", True, timeout=T)
        with pytest.raises(UpdateFailed, match="bogus") as err:
            mgr.update_weights(version=62)
        assert "rollout rank 0" in str(err.value) and "rollout rank 1" in str(err.value)
        assert err.value.versions == {"vllm0": 61} and mgr.versions() == {"vllm0": 61}
        assert [r.name for r in mgr.replicas] == ["vllm0"]  # kept, not dropped
        call(trainer, "add_bogus", False, timeout=T)
        update(63)
        mgr.remove_replicas(["vllm0"])  # elastic removal still works
        with pytest.raises(WeightbusError, match="no rollout replica"):
            mgr.update_weights(version=64)
        mgr.add_replicas([replica])
        update(65)
    finally:
        mgr.shutdown()
        trainer.shutdown()
        replica.shutdown()


# ------------------------------------------------------------------ sharded receive


def start_tp2(path):
    return vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                    max_model_len=128, max_num_seqs=4, seed=0, tensor_parallel_size=2,
                    weight_transfer_config={"backend": "weightbus"})


@pytest.mark.parametrize("world", [1, 2, 3])
def test_fsdp_trainers_send_each_worker_only_its_shard(tp2, world, tmp_path):
    from weightbus.comm import free_port as port
    name, path, llm = tp2
    group = LocalWorkerGroup(FSDPFamilyTrainer, world, path, port(), name="fsdp")
    replica = VLLMEngineReplica(OfflineLLMRollout(llm), name="vllm0")
    mgr = CheckpointEngineManager("gloo", group, [replica], timeout=T, pause_mode="keep")
    try:
        total, shard = call(group, "shard_bytes", 2, timeout=T)[0]
        for step in range(70 + 10 * world, 72 + 10 * world):
            call(group, "train_step", step, timeout=T)
            mgr.update_weights(version=step)
            assert greedy(llm) == call(group, "greedy", PROMPTS, 8, timeout=T)[0], step
            assert llm.collective_rpc(received) == [(shard, 0), (shard, 0)], (total, shard)
        assert shard < 0.6 * total
        if world == 3 and name == "qwen3-moe":
            # every parameter as a fresh engine loads it from the trainer's checkpoint (the MoE
            # model holds every layer kind the dense one has, and experts: one engine start)
            call(group, "save", str(tmp_path), timeout=T)
            fresh = start_tp2(str(tmp_path))
            try:
                want, held = fresh.collective_rpc(vllm_param_digests), digests(llm)
                for w, h in zip(want, held, strict=True):
                    assert [n for n in w if h[n] != w[n]] == [], f"{name}: differs from a fresh load"
                assert greedy(fresh) == greedy(llm)
            finally:
                fresh.llm_engine.engine_core.shutdown()
    finally:
        mgr.shutdown()
        group.shutdown()
        replica.shutdown()


def test_a_swapped_loader_is_recorded_again(tp2, free_port):
    """Worker 1's o_proj gets a loader that computes on its bytes: from the next update
    on that tensor reaches worker 1 whole (a fallback, counted) and goes through its
    loader; one that refuses fails the update before any byte is loaded, naming worker 1;
    the usual loader back, every tensor is placed again."""
    name, path, llm = tp2
    o_proj = "model.layers.0.self_attn.o_proj"
    tr = Trainers(path, free_port, OfflineLLMRollout(llm), world=1, timeout=T)
    try:
        good_update(llm, tr, 91)
        assert [f for _, f in llm.collective_rpc(received)] == [0, 0]
        llm.collective_rpc(swap_loader, args=(1, o_proj, "copy"))
        good_update(llm, tr, 92)
        (b0, f0), (b1, f1) = llm.collective_rpc(received)
        assert (f0, f1) == (0, 1) and b1 > b0
        llm.collective_rpc(swap_loader, args=(1, o_proj, "refuse"))
        served = digests(llm)
        tr.each("train_step", 93)
        with pytest.raises(WeightSyncError, match="rollout rank 1: .*no more updates") as err:
            tr.update(93)
        assert KEPT in str(err.value) and digests(llm) == served
        llm.collective_rpc(swap_loader, args=(1, o_proj, None))
        good_update(llm, tr, 94)
        assert [f for _, f in llm.collective_rpc(received)] == [0, 0]
    finally:
        llm.collective_rpc(swap_loader, args=(1, o_proj, None))
        tr.close()


def test_whole_tensors_placed_without_their_loaders(tp2, free_port):
    """``sharded=False, place=True``: every worker receives whole tensors and writes only
    its regions where its loaders would, calling none; it ends holding, bitwise, what
    vLLM's loaders make of the same weights."""
    name, path, llm = tp2
    tr = Trainers(path, free_port, OfflineLLMRollout(llm), world=1, timeout=T, sharded=False, place=True)
    try:
        good_update(llm, tr, 101)
        total = tr.rank0.engine.engine.last_stats.bytes
        assert llm.collective_rpc(received) == [(total, None), (total, None)]  # whole tensors
        placed = digests(llm)
    finally:
        tr.close()
    from weightbus.comm import free_port as another_port
    tr = Trainers(path, another_port(), OfflineLLMRollout(llm), world=1, timeout=T, sharded=False,
                  place=False)
    try:
        tr.each("train_step", 101)  # a fresh trainer, the same step: the same weights
        tr.update(102)  # through vLLM's loaders
        assert digests(llm) == placed
    finally:
        tr.close()


def test_who_receives_sharded_by_default():
    """Sharded where a replica has several workers, or where one TP=1 worker is the only
    receiver (its regions placed as they arrive); several TP=1 replicas keep the broadcast
    (a sharded plan is a copy per receiver); ``place=False`` at TP=1 and an explicit
    ``sharded`` win."""
    from weightbus.integrations.vllm.native import WeightbusInitInfo, sharded_by_default

    def info(**kw):
        return WeightbusInitInfo(master_address="127.0.0.1", master_port=1, **kw)

    assert sharded_by_default(info(rollout_world_size=4), workers=2)
    assert sharded_by_default(info(rollout_world_size=2, place=False), workers=2)
    assert sharded_by_default(info(rollout_world_size=1), workers=1)
    assert not sharded_by_default(info(rollout_world_size=3), workers=1)
    assert not sharded_by_default(info(rollout_world_size=1, place=False), workers=1)
    assert not sharded_by_default(info(rollout_world_size=4, sharded=False), workers=2)
    assert sharded_by_default(info(rollout_world_size=3, sharded=True), workers=1)
