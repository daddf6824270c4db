"""weightbus as vLLM's own weight-transfer backend (``weight_transfer_config={"backend":
"weightbus"}``), against a real vLLM engine (CPU build). Skipped where vLLM is not
installed; `make test` runs it in its own venv (.venv-vllm).

Two trainer ranks (replicas, like DDP; each sends its share of the buckets) take real
AdamW steps; rank 0 runs here next to the offline ``LLM`` and drives it, rank 1 is a
separate process."""

import os

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_workers import (  # noqa: E402
    BreakingSource,
    Trainers,
    expected_vllm_digests,
    vllm_param_digests,
)

from weightbus import WeightSyncError  # noqa: E402
from weightbus.integrations.vllm import (  # noqa: E402
    OfflineLLMRollout,
    VLLMEngineReplica,
)
from weightbus.integrations.vllm.loader import KEPT  # noqa: E402
from weightbus.runtime.group import LocalWorkerGroup, call  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [100, 7, 42], [5]]
T = 60  # seconds, every wait


def make_model(path, tied):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=256, tie_word_embeddings=tied)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(path)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """A tiny Qwen2 with tied embeddings (vLLM fuses qkv and gate_up) in one offline vLLM
    engine on the native backend, shared by the module's tests (start-up takes ~20 s)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(vllm_param_digests)
    path = str(tmp_path_factory.mktemp("tiny-qwen2-tied"))
    make_model(path, tied=True)
    engine = vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                      max_model_len=128, max_num_seqs=4, seed=0,
                      weight_transfer_config={"backend": "weightbus"})
    yield path, engine
    engine.llm_engine.engine_core.shutdown()


def assert_bitwise(llm, trainer):
    """Every parameter vLLM holds equals the trainer's bitwise, fused the way vLLM fuses
    them. On the CPU vLLM moves linear weights into oneDNN kernels and leaves the
    parameter empty: those are checked by the greedy tokens instead."""
    sd = {k: v for k, v in trainer.model.state_dict().items() if k != "lm_head.weight"
          or not trainer.model.config.tie_word_embeddings}
    got, want = llm.collective_rpc(vllm_param_digests)[0], expected_vllm_digests(sd)
    assert got.keys() == want.keys()
    held = [n for n in want if "[0]:" not in got[n]]
    assert len(held) >= 8  # embedding, norms, qkv biases
    assert [n for n in held if got[n] != want[n]] == []


def llm_digests(llm):
    return llm.collective_rpc(vllm_param_digests)[0]


def greedy(llm, n=8):
    sp = vllm.SamplingParams(max_tokens=n, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_native_updates_and_bad_input(llm, free_port):
    path, engine = llm
    rollout = OfflineLLMRollout(engine)
    tr = Trainers(path, free_port, rollout)
    try:
        previous = greedy(engine)
        for step in (1, 2, 3):
            losses = tr.each("train_step", step)
            assert losses[0] == losses[1]  # the two ranks hold the same replica
            tr.update(step)
            assert_bitwise(engine, tr.rank0)
            got = greedy(engine)
            assert got == tr.rank0.greedy(PROMPTS, 8), f"version {step}: vLLM != transformers"
            assert got != previous  # the weights really changed
            previous = got
            assert engine.get_weight_version() == str(step)  # recorded by finish_weight_update

        # bad input is rejected before anything loads: vLLM keeps serving version 3
        served = llm_digests(engine)
        hidden = tr.rank0.model.config.hidden_size
        bad = {
            "unknown name": ({"model.bogus.weight": torch.ones(4, 4)}, "bogus"),
            # inside a known module, or a layer the model does not have: vLLM's loader looks
            # the name up (a ValueError, AttributeError or KeyError inside vLLM): named as a
            # name the model does not know
            "unknown name in a layer": ({"model.layers.0.mlp.gate_bogus.weight": torch.ones(4, 4)},
                                        "does not know tensor 'model.layers.0.mlp.gate_bogus.weight'"),
            "a layer past the last": ({"model.layers.7.mlp.down_proj.weight": torch.ones(4, 4)},
                                      "does not know tensor 'model.layers.7.mlp.down_proj.weight'"),
            "shape mismatch": ({"model.layers.0.mlp.down_proj.weight": torch.ones(hidden, 7)},
                               "down_proj"),
            "missing tensor": ({"model.layers.1.self_attn.v_proj.weight": None}, "qkv_proj"),
        }
        for step, (what, (change, named)) in enumerate(bad.items(), start=4):
            tr.each("train_step", step)  # the trainer moved on; vLLM must not see any of it
            tr.each("set_source", change)
            with pytest.raises(WeightSyncError, match=named) as err:
                tr.update(step)
            assert KEPT in str(err.value), what
            assert greedy(engine) == previous, f"{what}: vLLM no longer serves version 3"
            assert llm_digests(engine) == served, f"{what}: vLLM's weights changed"
            assert engine.get_weight_version() == "3"

        # a trainer failing mid-stream: the update fails everywhere, the engine lives on
        tr.each("set_source")
        tr.rank0.engine.source = BreakingSource(tr.rank0.engine.source, after=5)
        with pytest.raises(WeightSyncError, match="mid-update"):
            tr.update(11)
        assert len(greedy(engine)[0]) == 8  # still generating (some layers are new, none garbage)

        # and the next good update lands whole
        tr.each("set_source")
        tr.update(12)
        assert greedy(engine) == tr.rank0.greedy(PROMPTS, 8)
        assert engine.get_weight_version() == "12"
    finally:
        tr.close()


def test_native_colocated_shared_memory(llm, free_port):
    """The same engine re-initialised onto the colocated transport (shared memory on CPU)."""
    path, engine = llm
    from vllm.distributed.weight_transfer import ModuleSource as VLLMModuleSource
    tr = Trainers(path, free_port, OfflineLLMRollout(engine), world=1, transport="colocated")
    try:
        for step in (13, 14, 15):
            if step == 15:  # vLLM's own WeightSource works as the source too
                tr.rank0.engine.source = VLLMModuleSource(tr.rank0.model)
            tr.each("train_step", step)
            tr.update(step, mode="abort")
            assert_bitwise(engine, tr.rank0)
            assert greedy(engine) == tr.rank0.greedy(PROMPTS, 8)
            assert engine.get_weight_version() == str(step)
    finally:
        tr.close()


def test_native_from_the_shm_cache(llm, free_port):
    """The trainer publishes into the host's shared-memory cache; the vLLM workers read the
    version from it like from any engine (the cache's files: safetensors, mapped)."""
    path, engine = llm
    tr = Trainers(path, free_port, OfflineLLMRollout(engine), world=1, transport="shm")
    try:
        for step in (21, 22):
            tr.each("train_step", step)
            tr.update(step, mode="abort")
            assert_bitwise(engine, tr.rank0)
            assert greedy(engine) == tr.rank0.greedy(PROMPTS, 8)
            assert engine.get_weight_version() == str(step)
    finally:
        tr.close()


def test_native_from_a_sharded_safetensors_checkpoint(llm, free_port, tmp_path):
    """A checkpoint that transformers' save_pretrained writes in shards (the trainer saves
    after each step) streams into vLLM through SafetensorsSource: bitwise, and the same
    into a ModuleSink of the trainer's model class."""
    from weightbus import ModuleSink
    from weightbus.integrations.safetensors import SafetensorsSource
    path, engine = llm
    tr = Trainers(path, free_port, OfflineLLMRollout(engine), world=1)
    try:
        for step in (41, 42):
            tr.each("train_step", step)
            ckpt = tmp_path / f"step{step}"
            tr.rank0.model.save_pretrained(ckpt, max_shard_size="300KB")
            assert (ckpt / "model.safetensors.index.json").exists()
            source = SafetensorsSource(ckpt)
            tr.rank0.engine.source = source
            tr.update(step, mode="abort")
            assert_bitwise(engine, tr.rank0)
            assert greedy(engine) == tr.rank0.greedy(PROMPTS, 8)
            copy = type(tr.rank0.model)(tr.rank0.model.config)
            report = ModuleSink(copy, strict=False).load_iter(iter(SafetensorsSource(ckpt)))
            assert report.loaded == len(source.manifest)
            for name, t in tr.rank0.model.state_dict().items():
                assert torch.equal(copy.state_dict()[name], t), name
    finally:
        tr.close()


def test_native_layers_spanning_many_buckets(llm, free_port):
    """vLLM's layerwise reload holds a layer's tensors until the layer is complete; with
    buckets far smaller than a layer, those tensors must outlive their bucket's reuse."""
    path, engine = llm
    tr = Trainers(path, free_port, OfflineLLMRollout(engine), world=2, bucket_size=16 << 10)
    try:
        for step in (31, 32):
            tr.each("train_step", step)
            tr.update(step)
            assert_bitwise(engine, tr.rank0)
            assert greedy(engine) == tr.rank0.greedy(PROMPTS, 8)
    finally:
        tr.close()


def test_manager_drives_native_replica(llm, free_port):
    """CheckpointEngineManager with a vLLM engine on the native backend as a replica."""
    from vllm_workers import HFTrainer

    from weightbus.manager import CheckpointEngineManager
    path, engine = llm
    trainer = LocalWorkerGroup(HFTrainer, 1, path, name="trainer")
    replica = VLLMEngineReplica(OfflineLLMRollout(engine), name="vllm0")
    mgr = CheckpointEngineManager("gloo", trainer, [replica], timeout=T, pause_mode="keep")
    try:
        for step in (21, 22):
            call(trainer, "train_step", step, timeout=T)
            mgr.update_weights(version=step)
            assert greedy(engine) == call(trainer, "greedy", PROMPTS, 8, timeout=T)[0]
            assert mgr.versions() == {"vllm0": step}
        call(trainer, "add_bogus", True, timeout=T)
        with pytest.raises(WeightSyncError, match="bogus"):
            mgr.update_weights(version=23)
        assert mgr.versions() == {"vllm0": 22}  # rejected up front: version 22 still served
    finally:
        mgr.shutdown()
        trainer.shutdown()
        replica.shutdown()
