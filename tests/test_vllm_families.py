"""Every model family the field trains, updated through the native backend into a real
vLLM (CPU build), must serve exactly what a fresh load of the same weights serves: dense
(Qwen3, GQA), MoE (Qwen3-MoE; Mixtral's expert layout), tied embeddings (Llama).

After each of several real AdamW steps the greedy tokens equal transformers' on the same
weights (and differ from the previous version's); after the last, every parameter vLLM
holds equals, bitwise, what a fresh vLLM engine loaded from the trainer's checkpoint
holds. The self-check runs on every update (all layers) and must pass; with the MoE
rebuild switched off it must fail the update, naming the experts layer."""

import os

import pytest

vllm = pytest.importorskip("vllm")

from vllm_workers import NativeTrainer, make_family_model, set_rebuild, vllm_param_digests  # noqa: E402

from weightbus import WeightSyncError  # noqa: E402
from weightbus.integrations.vllm import OfflineLLMRollout, RolloutClient, sync_weights  # noqa: E402

PROMPTS = [[1, 2, 3, 4], [100, 7, 42], [5, 300, 17]]
FAMILIES = ["qwen3", "qwen3-moe", "mixtral", "llama-tied"]
MOE = {"qwen3-moe", "mixtral"}


def start_llm(path, **kwargs):
    return vllm.LLM(model=path, skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
                    max_model_len=128, max_num_seqs=4, seed=0, **kwargs)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """One family's tiny model in one vLLM engine on the native backend, shared by the
    module's tests of that family."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc(functions)
    path = str(tmp_path_factory.mktemp(request.param))
    make_family_model(path, request.param)
    engine = start_llm(path, weight_transfer_config={"backend": "weightbus"})
    yield request.param, path, engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture
def trainer(family, free_port):
    name, path, engine = family
    rollout = OfflineLLMRollout(engine)
    client = RolloutClient([rollout])
    tr = NativeTrainer(0, 1, path, free_port, rollout.size, "gloo", self_check_every=1)
    tr.connect(client)
    tr.client = client
    yield tr
    tr.shutdown()


def greedy(llm, n=8):
    sp = vllm.SamplingParams(max_tokens=n, temperature=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def digests(llm):
    return llm.collective_rpc(vllm_param_digests)[0]


def test_updates_serve_what_a_fresh_load_serves(family, trainer, tmp_path):
    name, _, engine = family
    previous = greedy(engine)
    assert previous == trainer.greedy(PROMPTS, 8), f"{name}: the first load already differs"
    for step in (1, 2, 3):
        trainer.train_step(step)
        sync_weights(trainer.engine, trainer.client, step)  # self-checked, all layers
        got = greedy(engine)
        assert got == trainer.greedy(PROMPTS, 8), f"{name} version {step}: vLLM != transformers"
        assert got != previous, f"{name} version {step}: the tokens did not change"
        previous = got
        assert engine.get_weight_version() == str(step)

    trainer.save(str(tmp_path))
    fresh = start_llm(str(tmp_path))
    try:
        want, held = digests(fresh), digests(engine)
        assert held.keys() == want.keys()
        assert [n for n in want if held[n] != want[n]] == [], f"{name}: differs from a fresh load"
        assert greedy(fresh) == previous
    finally:
        fresh.llm_engine.engine_core.shutdown()


def test_self_check_catches_a_skipped_repack(family, trainer):
    name, _, engine = family
    if name not in MOE:
        pytest.skip("no experts to repack in a dense model")
    engine.collective_rpc(set_rebuild, args=(False,))
    try:
        trainer.train_step(10)
        with pytest.raises(WeightSyncError, match=r"self-check.*experts.*w13_weight differs"):
            sync_weights(trainer.engine, trainer.client, 10)
        assert engine.get_weight_version() != "10"
    finally:
        engine.collective_rpc(set_rebuild, args=(True,))
    sync_weights(trainer.engine, trainer.client, 11)  # the next update repairs the model
    assert greedy(engine) == trainer.greedy(PROMPTS, 8)
    assert engine.get_weight_version() == "11"
