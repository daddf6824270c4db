"""The worker-extension fallback (for vLLMs without the native weight-transfer API): a
real vLLM engine (CPU) as a rollout replica of the manager. Skipped where vLLM is not
installed; `make test` runs it in its own venv (.venv-vllm)."""

import os

import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_workers import HFTrainer  # noqa: E402

from weightbus import WeightSyncError  # noqa: E402
from weightbus.integrations.vllm import VLLMReplica  # noqa: E402
from weightbus.manager import CheckpointEngineManager  # noqa: E402
from weightbus.runtime.group import LocalWorkerGroup, call  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [100, 7, 42], [5]]


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def engine(request, tmp_path_factory):
    """A tiny Qwen2 (fused qkv and gate_up inside vLLM; tied or untied embeddings) and one
    vLLM engine per model, shared by the module's tests (start-up takes ~20 s)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import Qwen2Config, Qwen2ForCausalLM
    path = str(tmp_path_factory.mktemp("tiny-qwen2"))
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=256, tie_word_embeddings=request.param)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    llm = vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                   max_model_len=128, max_num_seqs=4, seed=0,
                   worker_extension_cls="weightbus.integrations.vllm.WeightbusWorkerExtension")
    yield path, llm
    llm.llm_engine.engine_core.shutdown()
    del llm


def _vllm_greedy(llm, n=8):
    sp = vllm.SamplingParams(max_tokens=n, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_updates_land_in_vllm(engine):
    path, llm = engine
    trainer = LocalWorkerGroup(HFTrainer, 1, path, name="trainer")
    replica = VLLMReplica(llm, name="vllm0")
    mgr = CheckpointEngineManager("gloo", trainer, [replica], timeout=60)
    try:
        previous = _vllm_greedy(llm)
        for step in (1, 2, 3):
            call(trainer, "train_step", step, timeout=60)
            report = mgr.update_weights(version=step)
            got = _vllm_greedy(llm)
            want = call(trainer, "greedy", PROMPTS, 8, timeout=60)[0]
            assert got == want, f"version {step}: vLLM {got} != transformers {want}"
            assert got != previous  # the weights really changed
            previous = got
            assert llm.collective_rpc("wb_version") == [step]  # the version, seen through vLLM
            assert report.bytes > 0

        # a tensor vLLM does not know: rejected before anything loads, naming it; the
        # engine lives on and still serves version 3
        call(trainer, "train_step", 4, timeout=60)
        call(trainer, "add_bogus", True, timeout=60)
        with pytest.raises(WeightSyncError, match="bogus"):
            mgr.update_weights(version=4)
        assert llm.collective_rpc("wb_version") == [3]
        assert _vllm_greedy(llm) == previous
        call(trainer, "add_bogus", False, timeout=60)
        mgr.update_weights(version=5)
        assert _vllm_greedy(llm) == call(trainer, "greedy", PROMPTS, 8, timeout=60)[0]
    finally:
        mgr.shutdown()
        trainer.shutdown()
        replica.shutdown()


def test_delta_updates_land_in_vllm(engine):
    """Delta mode into vLLM's own loader: the first update goes whole, the next ones as
    the changes only (into each worker's shadow copy, then through load_weights)."""
    path, llm = engine
    trainer = LocalWorkerGroup(HFTrainer, 1, path, name="trainer")
    replica = VLLMReplica(llm, name="vllm0")
    mgr = CheckpointEngineManager("gloo", trainer, [replica], timeout=60, delta=True)
    try:
        call(trainer, "train_step", 1, timeout=60)
        dense = mgr.update_weights(version=1)
        assert dense.delta is False  # nothing held yet: whole
        previous = _vllm_greedy(llm)
        assert previous == call(trainer, "greedy", PROMPTS, 8, timeout=60)[0]
        for step in (2, 3):
            call(trainer, "sparse_step", step, timeout=60)
            report = mgr.update_weights(version=step)
            assert report.delta is True and report.wire_bytes < dense.wire_bytes / 4, report
            got = _vllm_greedy(llm)
            assert got == call(trainer, "greedy", PROMPTS, 8, timeout=60)[0], f"version {step}"
            assert got != previous
            previous = got
            assert llm.collective_rpc("wb_version") == [step]
    finally:
        mgr.shutdown()
        trainer.shutdown()
        replica.shutdown()
