"""Layer 3, sender side: how an update's weights are read (a source with a manifest, or a
plain iterable of ``(name, tensor)``), checked against the manifest, and walked in order."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from weightbus.errors import PlanError
from weightbus.packing import buffers
from weightbus.plan import Manifest, TensorMeta


class Stream:
    """The sender's view of one update's weights: a manifest plus an iterator that yields
    ``(name, tensor)`` in manifest order (tensor ``None`` where this rank need not hold it)."""

    def __init__(self, manifest: Manifest, open_: Callable[..., Iterator[tuple[str, torch.Tensor | None]]],
                 strict_dtype: bool, plain: Callable[[], list[torch.Tensor] | None] | None = None):
        self.manifest = manifest
        self.open = open_
        self.strict_dtype = strict_dtype
        self._plain = plain
        self._tensors: list[torch.Tensor] | None = None
        #: the source object, where there is one (delta mode asks it for local pieces; a
        #: colocated trainer in direct mode, to write into the rollout's tensors)
        self.source: Any = None

    @property
    def tensors(self) -> list[torch.Tensor] | None:
        """Every tensor, in manifest order, where the source holds them all as plain
        tensors (its ``plain_tensors()``, asked on first use: an engine that has the source
        write elsewhere never makes them): the sender then packs with no per-tensor step."""
        if self._plain is not None:
            self._tensors, self._plain = self._plain(), None
        return self._tensors

    def checked_tensors(self, checked_before: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """:attr:`tensors`, once checked against the manifest in bulk (a mismatch names the
        tensor), or None where the source has no such list. ``checked_before`` is the list
        this engine checked on its last update: the same list object (a source that holds
        its tensors by reference) against the same manifest is not checked again."""
        if self.tensors is None:
            return None
        if self.tensors is checked_before:
            return self.tensors
        metas = self.manifest.metas
        tensors = self.tensors
        if len(tensors) != len(metas):
            raise PlanError(f"the weight source holds {len(tensors)} tensors, its manifest {len(metas)}")
        # in bulk: one list comparison for the shapes, and castability per distinct pair of
        # dtypes (it depends on nothing else); the per-tensor check runs only to name a culprit
        bad = [t.shape for t in tensors] != self.manifest.shapes
        for have, want in {(t.dtype, m.dtype) for t, m in zip(tensors, metas, strict=True)}:
            if have is not want and not (have.is_floating_point and want.is_floating_point):
                bad = True
        if bad:
            for t, m in zip(tensors, metas, strict=True):
                buffers.check_castable(m, t)
        return tensors


def resolve_stream(weights: Any, cached: Manifest | None) -> Stream:
    """Find the manifest of ``weights`` without materialising it where possible.

    - a source with a ``manifest`` (``weightbus.sources``) says it; if it also has
      ``iter_for(owners, rank)`` only the ranks that pack a tensor materialise it;
    - a plain iterable is assumed to match the previous update's manifest and is checked
      tensor by tensor as it streams;
    - a plain iterable on the first update is read once to learn its manifest.
    """
    manifest = getattr(weights, "manifest", None)
    if isinstance(manifest, Manifest):
        if hasattr(weights, "iter_for"):
            def open_(plan: Any, owners: Any, rank: int, into: Any = None) -> Any:
                if into is not None:
                    return weights.iter_for(owners, rank, into=into)
                return weights.iter_for(owners, rank)
            stream = Stream(manifest, open_, False, getattr(weights, "plain_tensors", None))
            stream.source = weights
            return stream
        return Stream(manifest, lambda plan, owners, rank: iter(weights), False)
    if isinstance(weights, Mapping):
        raise PlanError(f"the weights are a {type(weights).__name__} of {len(weights)} entries; pass "
                        f"ModuleSource(weights) (the dtype policy, sharded tensors, no per-tensor "
                        f"steps) or weights.items()")
    if isinstance(weights, torch.Tensor | str | bytes) or not isinstance(weights, Iterable):
        raise PlanError(f"the weights must be a source (ModuleSource) or an iterable of (name, tensor) "
                        f"pairs, got {type(weights).__name__}")
    if cached is not None:
        return Stream(cached, lambda plan, owners, rank: iter(weights), True)
    items = list(weights)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise PlanError(f"the weight stream must yield (name, tensor) pairs, got {type(item).__name__} "
                            f"{str(item)[:60]!r}; a dict of tensors goes in ModuleSource(d) or d.items()")
    return Stream(Manifest.from_tensors(items), lambda plan, owners, rank: iter(items), True)


def fetch(it: Iterator[tuple[str, torch.Tensor | None]], meta: TensorMeta, position: int,
           strict_dtype: bool) -> torch.Tensor | None:
    try:
        name, t = next(it)
    except StopIteration:
        raise PlanError(f"the weight stream ended early: it has no tensor {meta.describe()} "
                        f"(position {position})") from None
    except Exception as e:  # noqa: BLE001 - the user's iterator is dead now
        raise StreamBroken(e) from e
    if name != meta.name:
        raise PlanError(f"the weight stream gives {name!r} where the manifest has "
                        f"{meta.describe()} (position {position})")
    if t is None:
        return None
    if t.dtype is not meta.dtype:
        buffers.check_castable(meta, t)
        if strict_dtype:
            raise PlanError(f"tensor {name!r} changed dtype from {meta.dtype} to {t.dtype} since the "
                            f"manifest was taken; pass a source with a manifest to cast")
    elif t.shape != meta.shape:
        buffers.check_castable(meta, t)
    return t


class StreamBroken(Exception):
    """The user's iterator raised: it cannot be advanced any more."""
