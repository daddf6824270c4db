"""Hugging Face transformers models as a trainer-side source.

A rollout engine (vLLM, SGLang) loads weights under the names and layouts of the model's
*checkpoint*. transformers 5 keeps some weights in memory in another layout than it saves
them: a MoE layer's experts are one fused 3-D tensor per projection in memory
(``mlp.experts.gate_up_proj``) and one 2-D tensor per expert and projection on disk
(``mlp.experts.0.gate_proj.weight``). transformers' own save-time conversion
(``revert_weight_conversion``) maps one to the other; some of its outputs are copies, not
views, so they must be made again for every update (a source built once would send the
first version's experts forever). :class:`HFCheckpointSource` does that, one module at a
time, so the copies never hold more than one module's weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from weightbus.sources import ModuleSource


class _Uncopied(torch.overrides.TorchFunctionMode):
    """``Tensor.contiguous`` returns its tensor as it is. transformers' reverse conversions
    make each piece contiguous (a MoE layer's fused ``gate_up_proj`` is copied whole, 0.8 GB
    for a Qwen3-30B-A3B layer, before its first expert can be sent); the engines copy
    every tensor into a bucket anyway, so a view saves a copy of the layer, and the
    pieces of a split along rows (one expert's gate) are contiguous views already."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.contiguous and not kwargs and len(args) == 1:
            return args[0]
        return func(*args, **(kwargs or {}))


def _convert(model: Any, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: memory and checkpoint layouts are the same
        return state
    if isinstance(model, _Converting) and not model._weight_conversions:
        return state  # (what transformers returns too, once it has walked the model)
    try:
        with _Uncopied():
            return revert_weight_conversion(model, state)
    except RuntimeError:  # an op that needs the copy (a ``view`` of a strided piece)
        return revert_weight_conversion(model, state)


class _Converting:
    """``model`` with its save-time conversions looked up once: transformers looks them
    up on every call (a walk over every module, for every module converted: 0.15 s per
    update of a 0.5B model), unless the model carries them (``_weight_conversions``, set
    by ``from_pretrained``). Everything else is the model's."""

    def __init__(self, model: Any):
        self._model = model
        conversions = getattr(model, "_weight_conversions", None)
        if conversions is None:
            try:  # (what revert_weight_conversion does for a model made from its config)
                from transformers.conversion_mapping import get_model_conversion_mapping
                from transformers.core_model_loading import PrefixChange
            except ImportError:
                conversions = None
            else:
                conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                               if not isinstance(c, PrefixChange)]
        self._weight_conversions = conversions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


def _groups(model: Any) -> list[dict[str, torch.Tensor]]:
    """The model's state dict split by owning module, in order; a weight tied to another
    (a tied ``lm_head``) appears once, under its first name, as ``save_pretrained``
    writes it."""
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in model.state_dict().items():
        local = _local(t)
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(t.shape)) \
            if local.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen.add(key)
        groups.setdefault(name.rpartition(".")[0], {})[name] = t
    return list(groups.values())


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor
    return t.to_local() if isinstance(t, DTensor) else t


def _gathered(group: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A module's tensors whole: an FSDP2 (DTensor) shard is gathered, a collective that
    every rank of its mesh runs in the same order."""
    from torch.distributed.tensor import DTensor
    return {n: t.full_tensor() if isinstance(t, DTensor) else t for n, t in group.items()}


def checkpoint_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """``model``'s weights under its checkpoint's names and layouts, as ``save_pretrained``
    would write them (some are copies: call it again after the weights change). A model
    under FSDP2 is gathered module by module (every rank calls it)."""
    out: dict[str, torch.Tensor] = {}
    converting = _Converting(model)
    for group in _groups(model):
        out.update(_convert(converting, _gathered(group)))
    return out


def _checkpoint_metas(model: _Converting) -> dict[str, torch.Tensor]:
    """The names, shapes and dtypes :func:`checkpoint_state_dict` gives, on the meta
    device (nothing gathered or copied)."""
    out: dict[str, torch.Tensor] = {}
    for group in _groups(model._model):
        metas = {n: torch.empty(t.shape, dtype=t.dtype, device="meta") for n, t in group.items()}
        out.update(_convert(model, metas))
    return out


class HFCheckpointSource:
    """A transformers model as a weight source, under its checkpoint's names and layouts.

    Converted anew at every update, one module at a time (the extra memory is one
    module's converted weights). Under FSDP2 each module is gathered first, on every rank
    (every rank iterates the source whole, as the engines do). ``dtype`` is the wire dtype
    of floating-point tensors, as for :class:`~weightbus.sources.ModuleSource`."""

    def __init__(self, model: Any, *, dtype: torch.dtype | None = None):
        self.model, self.dtype = model, dtype
        self._converting = _Converting(model)
        self.manifest = ModuleSource(_checkpoint_metas(self._converting), dtype=dtype).manifest

    def _converted(self) -> Iterator[tuple[str, torch.Tensor]]:
        for group in _groups(self.model):
            yield from _convert(self._converting, _gathered(group)).items()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._converted():
            yield name, t.detach()

    def iter_for(self, owners: Callable[[int], frozenset[int]], rank: int,
                 into: Any = None) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Every rank holds the whole model here: each yields every tensor (the engine
        packs only its own buckets)."""
        return iter(self)
