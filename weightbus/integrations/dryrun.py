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


def load_into(meta: torch.Tensor, original: Any, args: tuple, kwargs: dict[str, Any],
              recorder: Any = None, owner: tuple[torch.nn.Module, str, str] | None = None
              ) -> tuple[Any, int]:
    """One call of a parameter's loader (``original(param, *args, **kwargs)``) made into its
    meta stand-in ``meta`` instead: the loaded tensor's kind checked first, the elements it
    copies counted. With a :class:`~weightbus.integrations.placement.Recorder` (and the
    parameter's ``owner``: its module, the module's name, the parameter's name), the call
    runs under it, which records where each region lands. Returns ``(the loader's result,
    the elements it copied)``."""
    w = args[0] if args else kwargs.get("loaded_weight")
    if isinstance(w, torch.Tensor) and kind(w.dtype) != kind(meta.dtype):
        # a loader's copy_ would cast it silently (bools or integers into weights)
        raise TypeError(f"a {w.dtype} tensor cannot load into a {meta.dtype} parameter")
    with CopyCounter() as counter:
        if recorder is None:
            out = original(meta, *args, **kwargs)
        else:
            mod, mod_name, pname = owner  # type: ignore[misc]
            out = recorder.loading(mod, mod_name, pname, meta, w, lambda: original(meta, *args, **kwargs))
    return out, counter.numel


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
