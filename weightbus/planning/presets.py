"""Model-shaped workloads for benchmarks: the state-dict layout of Qwen3 models (public
HF config numbers), so tensor counts and shapes are realistic."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

QWEN3: dict[str, dict[str, int | bool]] = {
    # a tiny member of the family, for smoke runs and CI
    "tiny": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
             "vocab_size": 4096, "tie_word_embeddings": False},
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936, "tie_word_embeddings": True},
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "vocab_size": 151936, "tie_word_embeddings": False},
    "qwen3-32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                  "vocab_size": 151936, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {"hidden_size": 2048, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                      "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
}
ALIASES = {"0.6b": "qwen3-0.6b", "8b": "qwen3-8b", "32b": "qwen3-32b", "30b-a3b": "qwen3-30b-a3b"}


def stress(tensors: int, tensor_bytes: int) -> str:
    """The name of a stress preset: ``tensors`` flat tensors of ``tensor_bytes`` bf16 bytes
    each (per-tensor costs, with no model shape in the way)."""
    if tensors < 1 or tensor_bytes < 2 or tensor_bytes % 2:
        raise ValueError(f"a stress preset needs tensors >= 1 and an even tensor size >= 2 bytes, "
                         f"got {tensors} x {tensor_bytes}")
    return f"{tensors}x{tensor_bytes}B"


def _stress(preset: str) -> tuple[int, int] | None:
    n, x, b = preset.removesuffix("B").partition("x")
    return (int(n), int(b)) if x and n.isdigit() and b.isdigit() and preset.endswith("B") else None


def names() -> list[str]:
    """Every preset name (the stress presets, ``NxBB``, are made by :func:`stress`)."""
    return [*ALIASES, *QWEN3]


def check(preset: str, layers: int | None = None) -> str:
    """``preset`` if known (and ``layers`` fits it), else a ValueError naming the choices."""
    if _stress(preset) is None and ALIASES.get(preset, preset) not in QWEN3:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(names())}, "
                         f"or a stress preset (--tensors N --tensor-bytes B)")
    if layers is not None and (layers < 1 or _stress(preset) is not None):
        raise ValueError(f"--layers {layers}: needs a model preset and at least one layer")
    return preset


def shapes(preset: str, layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of the preset, in HF state-dict order; ``layers``
    keeps only the first N decoder layers (so a big model's shape fits one GPU)."""
    check(preset, layers)
    st = _stress(preset)
    if st is not None:
        return [(f"stress.{i}.weight", (st[1] // 2,)) for i in range(st[0])]
    return config_shapes(QWEN3[ALIASES.get(preset, preset)], layers)


def config_shapes(config: Mapping[str, Any], layers: int | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of a Qwen3-family config (dense, or MoE with
    ``num_experts``), in HF state-dict order: what :func:`shapes` lays out for a preset,
    for any config with the same keys (a Hugging Face ``config.json``'s)."""
    c = dict(config)
    if layers is not None:
        c["num_hidden_layers"] = min(layers, int(c["num_hidden_layers"]))
    h, heads, kv, hd = (int(c[k]) for k in ("hidden_size", "num_attention_heads",
                                            "num_key_value_heads", "head_dim"))
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (int(c["vocab_size"]), h))]
    for i in range(int(c["num_hidden_layers"])):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (heads * hd, h)),
                (p + "self_attn.k_proj.weight", (kv * hd, h)),
                (p + "self_attn.v_proj.weight", (kv * hd, h)),
                (p + "self_attn.o_proj.weight", (h, heads * hd)),
                (p + "self_attn.q_norm.weight", (hd,)),
                (p + "self_attn.k_norm.weight", (hd,))]
        if "num_experts" in c:
            e, m = int(c["num_experts"]), int(c["moe_intermediate_size"])
            out.append((p + "mlp.gate.weight", (e, h)))
            for j in range(e):
                q = f"{p}mlp.experts.{j}."
                out += [(q + "gate_proj.weight", (m, h)), (q + "up_proj.weight", (m, h)),
                        (q + "down_proj.weight", (h, m))]
        else:
            m = int(c["intermediate_size"])
            out += [(p + "mlp.gate_proj.weight", (m, h)), (p + "mlp.up_proj.weight", (m, h)),
                    (p + "mlp.down_proj.weight", (h, m))]
        out += [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,))]
    out.append(("model.norm.weight", (h,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (int(c["vocab_size"]), h)))
    return out


def nbytes(preset: str, itemsize: int = 2, layers: int | None = None) -> int:
    total = 0
    for _, s in shapes(preset, layers):
        n = 1
        for d in s:
            n *= d
        total += n * itemsize
    return total
