"""Where each update tensor's bytes land in an inference engine's model (vLLM's, SGLang's),
recorded from the engine's own weight loaders, once per manifest.

Each engine's preflight already runs ``model.load_weights`` over meta stand-ins of the
update's tensors (:mod:`weightbus.integrations.vllm.loader`,
:mod:`weightbus.integrations.sglang.worker`). Given a :class:`Recorder`, those stand-ins are
:class:`_Tracked` tensors, which know the region (a :class:`~weightbus.packing.shards.Box`)
of the update tensor they are: a loader that narrows, selects, chunks or indexes them (the
row or column slice of a tensor-parallel layer, the q/k/v and gate/up pieces of a fused
parameter, an expert's slot) gets a tracked child; its ``copy_`` into the parameter records
a :class:`Scatter` (which region of which update tensor lands at which strided view of
which parameter). A loader that does more than place bytes (transposes, permutes, casts,
computes on them, copies from anything else, or runs outside a parameter's loader) makes
that tensor a *fallback*: it is received whole and goes through the engine's loader as
before. The result, a :class:`Placement`, is this rank's
:class:`~weightbus.packing.shards.ShardLayout` (what it keeps of each tensor), and what the
engine's side replays for each received region.

Written against vLLM 0.32's and SGLang 0.5.12's loaders (SGLang's are vLLM's, forked); an
engine without them places nothing (every tensor is a fallback).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from weightbus.packing.shards import Box, ShardLayout
from weightbus.plan import Manifest


@dataclass(frozen=True)
class Scatter:
    """Region ``box`` of update tensor ``name`` lands at ``param`` of ``layer`` (a
    module), at the view ``as_strided(box.size, stride, param offset + offset)``."""

    name: str
    box: Box
    layer: torch.nn.Module
    layer_name: str
    param: str
    offset: int
    stride: tuple[int, ...]

    def view(self, param: torch.Tensor) -> torch.Tensor:
        return param.data.as_strided(self.box.size, self.stride, param.storage_offset() + self.offset)


@dataclass(frozen=True)
class Fill:
    """A constant a loader writes into ``param`` beside the bytes it places (vocab
    padding rows zeroed), at the view ``as_strided(shape, stride, param offset + offset)``;
    written when the layer is materialized."""

    param: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    value: float

    def apply(self, param: torch.Tensor) -> None:
        param.data.as_strided(self.shape, self.stride, param.storage_offset() + self.offset).fill_(self.value)


@dataclass
class Placement:
    """What one manifest's dry run recorded: the scatters of every placed tensor, the
    constants loaders write beside them (by layer), and why each other tensor falls back
    to a whole tensor through the engine's loader."""

    scatters: dict[str, list[Scatter]]
    fallbacks: dict[str, str]
    layout: ShardLayout
    fills: dict[torch.nn.Module, list[Fill]]

    def describe(self) -> str:
        some = ", ".join(f"{n} ({why})" for n, why in list(self.fallbacks.items())[:3])
        more = f", ... ({len(self.fallbacks) - 3} more)" if len(self.fallbacks) > 3 else ""
        regions = sum(map(len, self.scatters.values()))
        return (f"{len(self.scatters)} tensor(s) placed in {regions} region(s), {len(self.fallbacks)} "
                f"through the engine's loader" + (f": {some}{more}" if self.fallbacks else ""))


class Recorder:
    """Collects scatters during one dry run of ``model.load_weights`` (see the module doc).
    The dry run calls :meth:`tracked` for each update tensor, and wraps each parameter's
    loader call in :meth:`loading`."""

    def __init__(self) -> None:
        self.scatters: dict[str, list[Scatter]] = {}
        self.fallbacks: dict[str, str] = {}
        self.fills: dict[torch.nn.Module, list[Fill]] = {}
        self._current: tuple[torch.nn.Module, str, str, torch.Tensor] | None = None
        self._writes: _Writes | None = None

    def tracked(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return _Tracked(self, name, Box.whole(shape), tuple(range(len(shape))), dtype)

    def fallback(self, name: str, why: str) -> None:
        self.fallbacks.setdefault(name, why)

    def loading(self, layer: torch.nn.Module, layer_name: str, param: str, meta: torch.Tensor,
                weight: Any, call: Callable[[], Any]) -> Any:
        """Run one loader call (``call``) of ``param`` of ``layer`` into its meta stand-in.
        Any other write into the parameter during it (a second copy, an in-place scale)
        makes the call's tensor fall back: replaying only its regions would miss it."""
        self._current = (layer, layer_name, param, meta)
        writes = self._writes = _Writes(meta.untyped_storage()._cdata)
        placed = len(self.scatters.get(weight._name, ())) if isinstance(weight, _Tracked) else 0
        try:
            with writes:
                return call()
        finally:
            self._current = self._writes = None
            if isinstance(weight, _Tracked):
                self._check_writes(weight._name, layer, param, meta, writes,
                                   self.scatters.get(weight._name, [])[placed:])

    def _check_writes(self, name: str, layer: torch.nn.Module, param: str, meta: torch.Tensor,
                      writes: _Writes, copies: list[Scatter]) -> None:
        """After one loader call: its constants are kept where they miss every region it
        copied (else, and for any other write, the tensor falls back)."""
        if writes.other:
            return self.fallback(name, f"its loader writes into {param!r} by {writes.other}")
        base = meta.storage_offset()
        for offset, shape, stride, value in writes.fills:
            fill = Fill(param, offset - base, shape, stride, value)
            if any(_meet(_span(fill.offset, shape, stride), _span(c.offset, c.box.size, c.stride))
                   for c in copies if c.param == param):
                return self.fallback(name, f"its loader fills part of {param!r} it also copies into")
            self.fills.setdefault(layer, []).append(fill)
        return None

    def copy(self, dest: torch.Tensor, src: _Tracked, index: Any, kwargs: dict[str, Any]) -> Any:
        """``dest.copy_(src)`` (or ``dest[index] = src``): record it, and copy on meta so
        the dry run counts it."""
        plain = torch.empty(src.shape, dtype=src.dtype, device="meta")
        with torch._C.DisableTorchFunctionSubclass(), _ours(self._writes):
            view = dest if index is None else dest[index]
            self._record(view, src)
            if index is None:
                return dest.copy_(plain, **kwargs)
            dest[index] = plain
            return None

    def _record(self, view: torch.Tensor, src: _Tracked) -> None:
        cur = self._current
        if cur is None:
            return self.fallback(src._name, "copied outside a parameter's weight loader")
        layer, layer_name, param, meta = cur
        if not view.is_meta or view.untyped_storage()._cdata != meta.untyped_storage()._cdata:
            return self.fallback(src._name, f"its loader copies it into something other than {param!r}")
        if tuple(view.shape) != tuple(src.shape):
            return self.fallback(src._name, "its loader broadcasts it")
        stride = [1] * len(src._box.size)
        for i, d in enumerate(src._dims):
            if d is not None:
                stride[d] = view.stride(i)
        self.scatters.setdefault(src._name, []).append(Scatter(
            src._name, src._box, layer, layer_name, param, view.storage_offset() - meta.storage_offset(),
            tuple(stride)))
        return None

    def result(self, manifest: Manifest,
               placeable: Callable[[torch.nn.Module, str], str | None]) -> Placement:
        """The placement of ``manifest``. ``placeable(layer, param)`` says why a parameter
        cannot be written in place (None: it can); its tensors fall back."""
        for name, scs in self.scatters.items():
            for sc in scs:
                why = placeable(sc.layer, sc.param)
                if why:
                    self.fallback(name, f"{sc.layer_name}.{sc.param}: {why}")
                    break
            else:
                boxes = list(dict.fromkeys(sc.box for sc in scs))
                if any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
                    self.fallback(name, "its loader copies overlapping regions of it")
        scatters = {n: s for n, s in self.scatters.items() if n not in self.fallbacks}
        boxes: dict[str, list[Box]] = {}
        for m in manifest.metas:
            if m.name not in self.fallbacks:  # (loaded nowhere on this rank: not wanted)
                boxes[m.name] = list(dict.fromkeys(sc.box for sc in scatters.get(m.name, [])))
        return Placement(scatters, {m.name: self.fallbacks[m.name] for m in manifest.metas
                                    if m.name in self.fallbacks}, ShardLayout(boxes), self.fills)


class _Writes(TorchDispatchMode):
    """Notes every write into one (meta) storage other than a recorded copy: a constant
    fill (kept, with its view), or anything else (named)."""

    def __init__(self, storage: int):
        super().__init__()
        self.storage, self.ours, self.other = storage, False, ""
        self.fills: list[tuple[int, tuple[int, ...], tuple[int, ...], float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.ours and not self.other and func._schema.is_mutable:
            for i, a in enumerate(func._schema.arguments):
                v = args[i] if i < len(args) else (kwargs or {}).get(a.name)
                if not (a.is_write and isinstance(v, torch.Tensor) and not isinstance(v, _Tracked)
                        and v.is_meta and v.untyped_storage()._cdata == self.storage and v.numel()):
                    continue
                value = 0.0 if func is torch.ops.aten.zero_.default else \
                    args[1] if func is torch.ops.aten.fill_.Scalar else None
                if value is None:
                    self.other = str(func)
                else:
                    self.fills.append((v.storage_offset(), tuple(v.shape), tuple(v.stride()), float(value)))
        return func(*args, **(kwargs or {}))


def _meet(a: range, b: range) -> bool:
    return a.start < b.stop and b.start < a.stop


def _span(offset: int, shape: Sequence[int], stride: Sequence[int]) -> range:
    """The storage offsets a strided view reaches, first to last (a superset of its
    elements: views whose spans miss each other are disjoint)."""
    return range(offset, offset + sum((n - 1) * st for n, st in zip(shape, stride, strict=True)) + 1)


@contextlib.contextmanager
def _ours(writes: _Writes | None) -> Iterator[None]:
    if writes is None:
        yield
        return
    writes.ours = True
    try:
        yield
    finally:
        writes.ours = False


# ------------------------------------------------------------------ the tracked stand-in


class _Tracked(torch.Tensor):
    """A meta stand-in for region ``_box`` of update tensor ``_name``. Its dimension ``i``
    is the box's dimension ``_dims[i]`` (None: a size-1 dimension added by indexing); box
    dimensions no ``_dims`` entry names have size 1. Slicing ops give tracked children;
    any op that computes on its values marks the tensor a fallback and runs on a plain
    meta tensor, so the dry run goes on."""

    _rec: Recorder
    _name: str
    _box: Box
    _dims: tuple[int | None, ...]

    @staticmethod
    def __new__(cls, rec: Recorder, name: str, box: Box, dims: tuple[int | None, ...],
                dtype: torch.dtype) -> _Tracked:
        shape = [box.size[d] if d is not None else 1 for d in dims]
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="meta")  # type: ignore[attr-defined]
        t._rec, t._name, t._box, t._dims = rec, name, box, dims
        return t

    def _child(self, box: Box, dims: tuple[int | None, ...]) -> _Tracked:
        return _Tracked(self._rec, self._name, box, dims, self.dtype)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "copy_" and len(args) >= 2 and isinstance(args[1], _Tracked) \
                and not isinstance(args[0], _Tracked):
            return args[1]._rec.copy(args[0], args[1], None, kwargs)
        if name == "__setitem__" and len(args) == 3 and isinstance(args[2], _Tracked) \
                and not isinstance(args[0], _Tracked):
            return args[2]._rec.copy(args[0], args[2], args[1], {})
        if args and isinstance(args[0], _Tracked) and name in _VIEWS:
            try:
                out = _VIEWS[name](args[0], *args[1:], **kwargs)
            except (TypeError, ValueError, IndexError):
                out = None  # (a form we do not follow: computed below, as a fallback)
            if out is not None:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        def plain(a: Any) -> Any:
            if isinstance(a, _Tracked):
                a._rec.fallback(a._name, f"its loader computes on it ({func})")
                return torch.empty(a.shape, dtype=a.dtype, device="meta")
            return a
        return func(*tree_map(plain, tuple(args)), **tree_map(plain, dict(kwargs or {})))


def _dim(t: _Tracked, d: int, extra: int = 0) -> int:
    n = len(t._dims) + extra
    if not -n <= d < n:
        raise IndexError(d)
    return d % n


def _narrow(t: _Tracked, dim: int, start: Any, length: Any) -> _Tracked | None:
    d = _dim(t, dim)
    start, length = int(start), int(length)
    size = t.shape[d]
    if start < 0:
        start += size
    if start < 0 or length < 0 or start + length > size:
        return None
    bd = t._dims[d]
    if bd is None:
        return t._child(t._box, t._dims) if (start, length) == (0, 1) else None
    begin, sizes = list(t._box.start), list(t._box.size)
    begin[bd] += start
    sizes[bd] = length
    return t._child(Box(tuple(begin), tuple(sizes)), t._dims)


def _select(t: _Tracked, dim: int, index: Any) -> _Tracked | None:
    d = _dim(t, dim)
    i = int(index)
    i = i + t.shape[d] if i < 0 else i
    one = _narrow(t, d, i, 1)
    return None if one is None else one._child(one._box, one._dims[:d] + one._dims[d + 1:])


def _getitem(t: _Tracked, index: Any) -> _Tracked | None:
    items = list(index) if isinstance(index, tuple) else [index]
    if any(not isinstance(x, (int, slice)) and x is not None and x is not Ellipsis for x in items) \
            or any(isinstance(x, bool) for x in items):
        return None  # tensor, list or mask indexing: values chosen by data
    if Ellipsis in items:
        k = items.index(Ellipsis)
        named = sum(1 for x in items if x is not None and x is not Ellipsis)
        items[k:k + 1] = [slice(None)] * (len(t._dims) - named)
    out: _Tracked | None = t
    d = 0
    for x in items:
        if out is None:
            return None
        if x is None:
            out = out._child(out._box, out._dims[:d] + (None,) + out._dims[d:])
            d += 1
        elif isinstance(x, int):
            out = _select(out, d, x)
        else:
            begin, end, step = x.indices(out.shape[d])
            if step != 1:
                return None
            out = _narrow(out, d, begin, max(0, end - begin))
            d += 1
    return out


def _cuts(n: int, sizes: Sequence[int]) -> list[tuple[int, int]]:
    out, at = [], 0
    for s in sizes:
        out.append((at, min(s, n - at)))
        at += s
    return out


def _split(t: _Tracked, split_size: Any, dim: int = 0) -> tuple[_Tracked, ...] | None:
    d = _dim(t, dim)
    n = t.shape[d]
    if isinstance(split_size, int):
        sizes = [split_size] * max(1, -(-n // split_size)) if split_size > 0 else []
    else:
        sizes = [int(s) for s in split_size]
        if sum(sizes) != n:
            return None
    parts = [_narrow(t, d, a, k) for a, k in _cuts(n, sizes) if k >= 0]
    return None if any(p is None for p in parts) else tuple(parts)  # type: ignore[arg-type]


def _chunk(t: _Tracked, chunks: int, dim: int = 0) -> tuple[_Tracked, ...] | None:
    n = t.shape[_dim(t, dim)]
    step = -(-n // int(chunks)) if n else 1
    return _split(t, step, dim) if n else None


def _unbind(t: _Tracked, dim: int = 0) -> tuple[_Tracked, ...] | None:
    d = _dim(t, dim)
    parts = [_select(t, d, i) for i in range(t.shape[d])]
    return None if any(p is None for p in parts) else tuple(parts)  # type: ignore[arg-type]


def _reshape(t: _Tracked, *shape: Any) -> _Tracked | None:
    """Only reshapes that add or drop size-1 dimensions keep a box's element order."""
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    if any(not isinstance(s, int) for s in shape):
        return None  # (view(dtype) and the like)
    sizes = list(shape)
    if -1 in sizes:
        known = 1
        for s in sizes:
            known *= s if s != -1 else 1
        sizes[sizes.index(-1)] = t.numel() // known if known else 0
    old = [(s, d) for s, d in zip(t.shape, t._dims, strict=True) if s != 1]
    if [s for s in sizes if s != 1] != [s for s, _ in old]:
        return None
    it = iter(d for _, d in old)
    return t._child(t._box, tuple(next(it) if s != 1 else None for s in sizes))


def _flatten(t: _Tracked, start_dim: int = 0, end_dim: int = -1) -> _Tracked | None:
    if not t._dims:
        return _reshape(t, 1)
    a, b = _dim(t, start_dim), _dim(t, end_dim)
    merged = 1
    for s in t.shape[a:b + 1]:
        merged *= s
    return _reshape(t, *t.shape[:a], merged, *t.shape[b + 1:])


def _squeeze(t: _Tracked, dim: Any = None) -> _Tracked:
    dims = range(len(t._dims)) if dim is None else \
        [_dim(t, d) for d in (dim if isinstance(dim, (tuple, list)) else [dim])]
    drop = {d for d in dims if t.shape[d] == 1}
    return t._child(t._box, tuple(x for i, x in enumerate(t._dims) if i not in drop))


def _unsqueeze(t: _Tracked, dim: int) -> _Tracked:
    d = _dim(t, dim, extra=1)
    return t._child(t._box, t._dims[:d] + (None,) + t._dims[d:])


def _same(t: _Tracked, *args: Any, **kwargs: Any) -> _Tracked:
    return t._child(t._box, t._dims)


#: the ops a loader may apply to the bytes it places: each keeps a region of the tensor
_VIEWS: dict[str, Callable[..., Any]] = {
    "narrow": _narrow, "select": _select, "__getitem__": _getitem, "split": _split,
    "chunk": _chunk, "unbind": _unbind, "view": _reshape, "reshape": _reshape,
    "flatten": _flatten, "squeeze": _squeeze, "unsqueeze": _unsqueeze,
    "contiguous": _same, "detach": _same,
}
