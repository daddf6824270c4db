"""Pieces of a dry run of an inference engine's own ``load_weights`` on meta tensors, shared
by the engines whose parameters carry vLLM-style ``weight_loader`` attributes (vLLM,
SGLang): the loaders' name mapping and shape checks run for real, nothing is written."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class CopyCounter(TorchDispatchMode):
    """Counts elements written by ``copy_`` (a loader may narrow, then copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.copy_.default:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


def loader_of(t: torch.Tensor) -> Any:
    """A parameter's ``weight_loader`` (None if it has none)."""
    try:
        return getattr(t, "weight_loader", None)
    except Exception:  # noqa: BLE001 - vLLM parameters raise once their loader is deleted
        return None


def kind(dtype: torch.dtype) -> str:
    """Which values a dtype holds: a loader may cast within a kind (fp32 -> bf16, fp8),
    never across kinds."""
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "int"


def meta_copy(t: torch.Tensor) -> torch.Tensor:
    """A meta tensor that stands for parameter ``t``: its class and attributes kept (the
    loaders read ``output_dim``, ``input_dim``...)."""
    meta = t.data.to("meta")
    meta.__class__ = t.__class__
    meta.__dict__ = t.__dict__.copy()
    return meta


def some(names: list[str], n: int = 5) -> str:
    """The first ``n`` of ``names``, and how many more."""
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")
