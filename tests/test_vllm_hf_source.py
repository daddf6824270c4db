"""HFCheckpointSource gives what transformers' own ``save_pretrained`` writes: the same
names and bitwise the same tensors, for dense, tied and MoE models (whose experts are
fused in memory and per expert on disk), and again after the weights change (the
conversions are copies, made anew each time). Needs transformers (the vLLM venv has it)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from weightbus.integrations.hf import HFCheckpointSource, checkpoint_state_dict  # noqa: E402

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1)
MODELS = {
    "qwen2-tied": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**SMALL, tie_word_embeddings=True)),
    "qwen3-moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SMALL, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SMALL, num_local_experts=4)),
}


def _saved(model, tmp_path) -> dict[str, torch.Tensor]:
    model.save_pretrained(tmp_path)
    out: dict[str, torch.Tensor] = {}
    for f in sorted(tmp_path.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(f))
    return out


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_source_equals_save_pretrained(arch, tmp_path):
    torch.manual_seed(0)
    model = MODELS[arch]()
    source = HFCheckpointSource(model)
    for step in range(2):
        if step:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-2).add_(1)
        want = _saved(model, tmp_path / str(step))
        got = dict(source)
        assert sorted(got) == sorted(want) == sorted(m.name for m in source.manifest)
        assert sorted(checkpoint_state_dict(model)) == sorted(want)
        for name, t in got.items():
            assert t.shape == want[name].shape and t.dtype == want[name].dtype, name
            assert torch.equal(t, want[name]), f"{arch} step {step}: {name} differs from save_pretrained's"
