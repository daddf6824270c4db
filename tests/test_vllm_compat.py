"""weightbus never breaks vLLM, and one trainer call drives every vLLM it supports.

Runs under each vLLM CPU build CI installs (`make test-vllm`: 0.32.0; `make
test-vllm-old`: 0.27.1, the oldest that installs here) with weightbus installed, its
``vllm.general_plugins`` entry point included:

- vLLM's own plugin loader runs weightbus's entry point without raising, and the backend
  is registered in the factories this vLLM has;
- an engine that does not use weightbus starts and generates;
- the README's vLLM block (``trainer_init``, ``sync_weights``) updates a real engine.

On the GPU machine, ``benchmarks/vllm_gpu.sh`` runs this module under vLLM 0.26.0 (the
0.24-0.26 API: no weight versions, the older trainer factory).
"""

import importlib.metadata as md
import os
import sys

import pytest

vllm = pytest.importorskip("vllm")

from test_readme import blocks, run_block  # noqa: E402

from weightbus.integrations.vllm import compat  # noqa: E402

README_BLOCK = next(b for b in blocks()
                    if b.values[0].startswith("<!-- run: vllm-python (tests/test_vllm_readme.py"))


def test_the_entry_point_is_installed_and_vllm_runs_it_without_raising():
    eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "weightbus"]
    assert eps, "weightbus's vllm.general_plugins entry point is not installed"
    from vllm.plugins import load_general_plugins
    load_general_plugins()  # what every vLLM process does as it starts (it raises what a plugin raises)
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    assert "weightbus" in WeightTransferEngineFactory._registry
    cls = WeightTransferEngineFactory._registry["weightbus"]()
    assert cls.__name__ == "WeightbusWeightTransferEngine"
    assert not getattr(cls, "__abstractmethods__", None), "vLLM's base class wants more methods"


def test_the_trainer_factory_builds_weightbus_where_this_vllm_has_one():
    from weightbus.integrations.vllm import WeightbusTrainerEngine
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:
        pytest.skip(f"vLLM {vllm.__version__} has no trainer factory (0.24-0.25): trainer_init needs none")
    assert WeightTransferTrainerFactory._registry["weightbus"]() is WeightbusTrainerEngine


def test_what_this_vllm_offers_is_read_off_it():
    v = compat.parse_version(vllm.__version__)
    api = compat.worker_api()
    assert api["lifecycle"] == (v >= (0, 26)) and api["vllm_config"] == (v >= (0, 26))
    calls = compat.Calls(vllm.LLM)
    assert calls.versions == (v >= (0, 27))
    assert calls.format_flag == (v < (0, 26))
    assert compat.support_note(vllm.__version__) is None
    assert compat.skip_load_tensors()  # (a name either way)


def test_an_engine_without_weightbus_starts_and_generates(tmp_path):
    """The failure verl users met: with weightbus installed, vLLM 0.24-0.27 refused to
    build any engine (the plugin raised inside vLLM's plugin loader)."""
    code = """
import sys, vllm
from transformers import Qwen3Config, Qwen3ForCausalLM
def main():
    Qwen3ForCausalLM(Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 head_dim=32)).save_pretrained("m")
    llm = vllm.LLM(model="m", dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       vllm.SamplingParams(max_tokens=4, temperature=0, detokenize=False), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    print("generated on vLLM", vllm.__version__)
    llm.llm_engine.engine_core.shutdown()
if __name__ == "__main__":
    main()
"""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run_block("<!-- run: python -->", code, tmp_path, python=sys.executable)


def test_the_readme_snippet_updates_this_vllm(tmp_path):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    marker, _, code = README_BLOCK.values
    run_block(marker, code, tmp_path, python=sys.executable)
