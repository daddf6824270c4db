"""Layer 4, trainer side: turn a model into the ``(name, tensor)`` stream engines send.

Name mapping and the dtype policy live here, not in engines. The source *declares* the
wire dtype in its manifest and hands over the tensors as they are; the engine's packer
casts while copying into the bucket, so the cast happens once, on the tensor's device.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from weightbus import comm, config
from weightbus.errors import PlanError
from weightbus.packing import native
from weightbus.packing.shards import chunk_box
from weightbus.plan import Manifest, TensorMeta, share_of, unsendable

NameMap = Callable[[str], "str | None"]

try:  # DTensor (FSDP2, TP) is optional at import time
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # pragma: no cover - torch without distributed tensor
    DTensor = None  # type: ignore[assignment,misc]
    Shard = None  # type: ignore[assignment,misc]


def _is_dtensor(t: Any) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _detached(t: torch.Tensor) -> torch.Tensor:
    """``t`` without autograd history; state-dict tensors have none already (and a
    ``detach()`` per tensor costs microseconds, per update, on every tensor)."""
    return t.detach() if t.requires_grad else t


class ModuleSource:
    """The weights of an ``nn.Module`` (or a state dict), in ``state_dict`` order.

    Args:
        weights: a module or a mapping of name to tensor; DTensor values (FSDP2, TP) are
            allowed.
        dtype: wire dtype for floating-point tensors (e.g. ``torch.bfloat16``); integer
            and bool tensors keep theirs. ``None`` keeps every dtype.
        name_map: trainer name -> rollout name; returning ``None`` drops the tensor.

    Iterating yields full tensors on every rank (DTensors are all-gathered), which is the
    contract every engine accepts. Engines that know which trainer rank packs a tensor
    call :meth:`iter_for` instead, which gathers a sharded tensor only to that rank.

    A source built once follows the module it was given, at every update: a parameter
    whose memory was replaced (``p.data = t``, ``model.to(...)``,
    ``load_state_dict(..., assign=True)``, a new ``nn.Parameter`` set on the module) is
    read where it is now, found by an identity and a pointer pass over every tensor
    (C-level, no per-tensor Python step). A tensor that no longer matches the manifest
    (another shape, another wire dtype, removed) fails the update before a byte moves,
    naming it: build a new source for the new set of tensors. A mapping's tensors are
    held themselves (new memory given to one is followed; an entry replaced in the mapping
    is not); a mapping of detached tensors (``model.state_dict()``) cannot follow the
    module: pass the module itself.
    """

    def __init__(self, weights: nn.Module | Mapping[str, torch.Tensor], *,
                 dtype: torch.dtype | None = None, name_map: NameMap | None = None):
        items = weights.state_dict() if isinstance(weights, nn.Module) else dict(weights)
        self.dtype = dtype
        self._items: list[tuple[str, torch.Tensor]] = []
        homes: list[tuple[Any, str] | None] = []  # where each tensor is read again at each update
        where = _homes(weights, items)
        metas = []
        splits: list[tuple[int, tuple[int, ...]] | None] = []  # (each trainer rank's own range)
        for name, t in items.items():
            if not isinstance(t, torch.Tensor):
                raise PlanError(f"ModuleSource: {name!r} is of type {type(t).__name__}, not a tensor; give "
                                f"it only the weights (a module, or a mapping of name to tensor)")
            why = unsendable(name, t) if not _is_dtensor(t) else None
            if why:
                raise PlanError(f"ModuleSource: {why}")
            out = name_map(name) if name_map is not None else name
            if out is None:
                continue
            if not isinstance(out, str):
                raise PlanError(f"ModuleSource: name_map({name!r}) returned a {type(out).__name__}; "
                                f"it must return the rollout's name (a str) or None to drop it")
            self._items.append((out, t))
            homes.append(where.get(name))
            metas.append(TensorMeta(out, self.wire_dtype(t), tuple(t.shape)))
            splits.append(_split_of(t) if _is_dtensor(t) else None)
        self.manifest = Manifest(metas, splits=splits)
        self._live = _Live(homes) if any(h is not None for h in homes) else None
        self._followed = False  # plain_tensors() just followed: the next iteration need not
        # Tensors with no autograd (a module's state dict) are held by reference: the list
        # an engine packs from is built once, and stays what the manifest was made from
        # (an optimizer updates them in place). Parameters are detached per update instead,
        # so that a swapped ``.data`` is followed.
        self._plain: list[torch.Tensor] | None = None
        if not any(_is_dtensor(t) or t.requires_grad for _, t in self._items):
            self._plain = [t for _, t in self._items]
        self._flat: _FlatGather | None = None
        self._to_owners: _ToOwners | None = None
        # per tensor held: (it, its mesh's group if it is dim-0 sharded on a 1-D mesh, else
        # None, its wire dtype): a DTensor's attributes cost microseconds, read once
        self._runnable: dict[int, tuple[Any, Any, torch.dtype]] = {}
        # per tensor: whether a DTensor is dim-0 sharded on a 1-D mesh (None: not a DTensor)
        self._sharded: list[bool | None] | None = None
        self._fit: dict[int, tuple[torch.Tensor, Any, int]] = {}
        self._hand: tuple[int, list[torch.Tensor | None]] | None = None  # (rank, at_hand(rank))

    def wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        # 8-bit floats (fp8 weights) are already a wire format: casting them up would double
        # their bytes and no longer match a rollout that holds them as fp8
        if self.dtype is not None and t.is_floating_point() and t.dtype.itemsize > 1:
            return self.dtype
        return t.dtype

    def __len__(self) -> int:
        return len(self._items)

    def follow(self) -> None:
        """Read every tensor where it lives now (see the class docstring); raises
        :class:`PlanError` naming a tensor that no longer fits the manifest. Every
        per-update entry point calls it."""
        live = self._live
        if live is None:
            return
        changed = live.changed()
        if not changed:
            return
        for i, now in changed:
            name, meta = self._items[i][0], self.manifest[i]
            if now is None:
                raise PlanError(f"ModuleSource: tensor {name!r} is gone from the module it was built from; "
                                f"build a new source (ModuleSource(model)) for the new set of weights")
            wire, shape = self.wire_dtype(now), tuple(now.shape)
            if wire != meta.dtype or shape != meta.shape:
                now_is = f"{str(now.dtype).removeprefix('torch.')}{list(shape)}"
                raise PlanError(f"ModuleSource: tensor {name!r} was replaced by a {now_is} tensor, where "
                                f"the source was built for {meta.describe()}; nothing was sent: build a new "
                                f"source (ModuleSource(model)) for the new weights")
            why = unsendable(name, now) if not _is_dtensor(now) else None
            if why:
                raise PlanError(f"ModuleSource: {why} (it was replaced since the source was built)")
        for i, now in changed:  # (all of them fit: follow them)
            t = now.detach() if not _is_dtensor(now) and now.requires_grad else now
            self._items[i] = (self._items[i][0], t)
            if self._plain is not None:
                self._plain[i] = t
        live.seen()
        self._fit.clear()  # (gather targets were worked out for the tensors held before)
        self._runnable.clear()
        self._sharded = None
        self._to_owners = None  # (its copy tables hold the tensors held before)
        self._hand = None

    def plain_tensors(self) -> list[torch.Tensor] | None:
        """Every tensor in manifest order, when none is sharded (no DTensor): an engine
        then packs straight from this list, with no per-tensor step; None otherwise. (An
        engine reads it once per update, first: the iteration that follows it in the same
        update does not look again.)"""
        self.follow()
        self._followed = True
        if self._plain is not None:
            return self._plain
        if any(_is_dtensor(t) for _, t in self._items):
            return None
        return [_detached(t) for _, t in self._items]

    def piece_owners(self) -> list[torch.Tensor] | None:
        """For delta updates: the tensors :meth:`local_pieces` cuts every piece from as a
        view (followed first, as every per-update entry point does), in manifest order: a
        tensor itself (a parameter's detached view shares its memory), or the local shard
        of an FSDP2 (dim-0 sharded) DTensor; None where a piece is a copy made per update
        (a DTensor of another layout: gathered). An engine keys work it replays on them
        while they are the very same tensors at the same addresses (a strided one's share
        is flattened by a copy: it checks that they are contiguous)."""
        if self.plain_tensors() is not None:
            return self._plain
        if self._sharded is None:  # (per tensor: a DTensor's attributes cost microseconds)
            self._sharded = [_gatherable(t) if _is_dtensor(t) else None for _, t in self._items]
        if False in self._sharded:
            return None
        # (a DTensor's own tensor: to_local() makes a new view of it per call)
        owners = [getattr(t, "_local_tensor", None) if dt else t
                  for (_, t), dt in zip(self._items, self._sharded, strict=True)]
        return None if any(o is None for o in owners) else owners

    def _follow_once(self) -> None:
        if self._followed:
            self._followed = False
        else:
            self.follow()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._follow_once()
        for name, t in self._items:
            yield name, t.full_tensor() if _is_dtensor(t) else _detached(t)

    def local_pieces(self, rank: int, world: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """For delta updates: ``(tensor index, first element, flat piece)`` of every tensor
        this trainer rank sends, with no communication where the rank holds it already:
        its own dim-0 shard of an FSDP2 DTensor (the elements ``[offset, offset + len)`` of
        the flattened full tensor), or its 1/``world`` of a tensor every rank holds whole.
        Any other DTensor layout is gathered (collectively, on every rank) and split."""
        self._follow_once()
        with torch.no_grad():
            for i, (_, t) in enumerate(self._items):
                if _is_dtensor(t) and _gatherable(t):
                    group = t.device_mesh.get_group()
                    n, me = t.shape[0], dist.get_rank(group)
                    rows = -(-n // dist.get_world_size(group)) if n else 0  # torch.chunk's split
                    lo = min(n, me * rows)
                    per_row = math.prod(t.shape[1:])
                    yield i, lo * per_row, t.to_local().reshape(-1)
                    continue
                full = t.full_tensor() if _is_dtensor(t) else _detached(t)
                yield i, *share_of(full, rank, world)

    def at_hand(self, rank: int) -> list[torch.Tensor | None]:
        """Every tensor as trainer rank ``rank`` holds it, with no communication, in
        manifest order: its own range of a tensor the manifest splits (a DTensor's local
        shard: ``manifest.splits``), a tensor that is not a DTensor whole, None for any
        other DTensor. Made once, and again where tensors moved (:meth:`follow`): an
        engine whose plan sends each rank's own ranges packs from it with no per-tensor
        step. Raises :class:`PlanError` where ``rank`` is not this process's rank in a
        split tensor's mesh (trainer rank r must be rank r of the mesh)."""
        self._follow_once()
        if self._hand is not None and self._hand[0] == rank:
            return self._hand[1]
        splits = self.manifest.splits or [None] * len(self._items)
        out: list[torch.Tensor | None] = []
        checked: set[int] = set()
        for (name, t), split in zip(self._items, splits, strict=True):
            if not _is_dtensor(t):
                out.append(_detached(t))
                continue
            if split is None:
                out.append(None)
                continue
            mesh = t.device_mesh
            if id(mesh) not in checked:
                if mesh.get_local_rank() != rank:
                    raise PlanError(f"ModuleSource: tensor {name!r} is sharded over a device mesh where this "
                                    f"process is rank {mesh.get_local_rank()}, but it sends as trainer rank "
                                    f"{rank}: trainer rank r must be rank r of the mesh")
                checked.add(id(mesh))
            out.append(_local(t).detach())
        self._hand = (rank, out)
        return out

    def iter_for(self, owners: Callable[[int], frozenset[int]], rank: int,
                 into: Callable[[int], torch.Tensor | None] | None = None
                 ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Like iterating, but a sharded tensor is materialised only on the trainer ranks
        in ``owners(i)``; the others get ``None``. Every trainer rank must iterate (the
        gathers are collectives of the tensor's mesh). Trainer rank r is taken to be rank
        r of the tensor's device-mesh group.

        ``into(i)`` may name where tensor i should land (wire dtype, full shape, e.g. the
        rollout's own parameter mapped over CUDA IPC): a gather to every rank then writes
        straight into it and the yielded tensor *is* that target."""
        self._follow_once()
        group: list[tuple[int, str, Any, torch.Tensor]] = []  # gathers into targets, batched
        group_bytes = 0
        run: list[tuple[int, str, Any, int, Any]] = []  # tensors each wanted on one rank, batched
        run_bytes = 0
        batched = config.flag("WEIGHTBUS_FLAT_GATHERS", default=True)
        for i, (name, t) in enumerate(self._items):
            target = into(i) if into is not None and _is_dtensor(t) else None
            if target is not None and self._gathers_into(i, t, target, owners):
                if run:
                    yield from self._run_to_owners(run)
                    run, run_bytes = [], 0
                group.append((i, name, t, target))
                group_bytes += target.nbytes
                if group_bytes >= _GROUP_BYTES:
                    yield from self._gather_group(group)
                    group, group_bytes = [], 0
                continue
            if group:
                yield from self._gather_group(group)
                group, group_bytes = [], 0
            need = owners(i) if _is_dtensor(t) else None
            pg = self._run_group(i, t) if need is not None and len(need) == 1 and batched else None
            if pg is not None and (not run or run[0][4] is pg):
                run.append((i, name, t, next(iter(need)), pg))  # type: ignore[arg-type]
                run_bytes += math.prod(t.shape) * self._runnable[i][2].itemsize
                if run_bytes >= _GROUP_BYTES:
                    yield from self._run_to_owners(run)
                    run, run_bytes = [], 0
                continue
            if run:
                yield from self._run_to_owners(run)
                run, run_bytes = [], 0
            if need is None:
                yield name, _detached(t)
            elif not need:  # (nobody packs it whole: no collective on any rank)
                yield name, None
            elif len(need) == 1 and _gatherable(t):
                yield name, _gather(t, self.wire_dtype(t), to=next(iter(need)))
            elif len(need) == t.device_mesh.size() and _gatherable(t):
                yield name, _gather(t, self.wire_dtype(t), to=None)
            else:
                full = t.full_tensor()
                yield name, full if rank in need else None
        if run:
            yield from self._run_to_owners(run)
        if group:
            yield from self._gather_group(group)

    def _run_group(self, i: int, t: Any) -> Any:
        """The process group of tensor ``i``'s mesh if it can join a run to owners (dim-0
        sharded on a 1-D mesh, and under ``_FLAT_MAX`` whole: a large tensor's gather costs
        what its bytes cost, and batching it would only hold more memory), else None."""
        known = self._runnable.get(i)
        if known is None or known[0] is not t:
            wire = self.wire_dtype(t)
            small = math.prod(t.shape) * wire.itemsize < _FLAT_MAX  # (a large one goes alone: as before)
            known = self._runnable[i] = (t, t.device_mesh.get_group() if small and _gatherable(t) else None,
                                         wire)
        return known[1]

    def _run_to_owners(self, run: list[tuple[int, str, Any, int, Any]]
                       ) -> Iterator[tuple[str, torch.Tensor | None]]:
        """A run of dim-0-sharded tensors, each wanted whole on one trainer rank, moved by
        one all-to-all (:class:`_ToOwners`); yields them in order, ``None`` where this
        rank is not the one."""
        if len(run) == 1:  # (one tensor: a gather is the same collective, without the copies)
            i, name, t, owner, _ = run[0]
            yield name, _gather(t, self._runnable[i][2], to=owner)
            return
        if self._to_owners is None:
            self._to_owners = _ToOwners()
        fulls = self._to_owners.run([(t, self._runnable[i][2], owner) for i, _, t, owner, _ in run],
                                    run[0][4], first=run[0][0])
        for (_, name, *_), full in zip(run, fulls, strict=True):
            yield name, full

    def _gathers_into(self, i: int, t: Any, target: torch.Tensor,
                      owners: Callable[[int], frozenset[int]]) -> bool:
        """Whether tensor ``i`` can be all-gathered straight into ``target`` (worked out once
        per target: a DTensor's attributes cost microseconds, and MoE models have
        thousands of tensors)."""
        known = self._fit.get(i)
        if known is None or known[0] is not target or known[1] is not t:
            ok = _gatherable(t) and _fits_into(t, target, self.wire_dtype(t))
            known = self._fit[i] = (target, t, t.device_mesh.size() if ok else -1)
        return len(owners(i)) == known[2]

    def _gather_group(self, group: list[tuple[int, str, Any, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """All-gather a run of sharded tensors straight into their targets. On one process
        group the small ones go as one flat all-gather (:class:`_FlatGather`); the rest,
        and every tensor with ``WEIGHTBUS_FLAT_GATHERS=0``, one gather each."""
        meshes = {id(t.device_mesh): t.device_mesh for _, _, t, _ in group}
        pgs = {id(pg): pg for pg in (m.get_group() for m in meshes.values())}
        if len(pgs) == 1 and config.flag("WEIGHTBUS_FLAT_GATHERS", default=True):
            pg = next(iter(pgs.values()))
            small = [g for g in group if g[3].nbytes < _FLAT_MAX]
            if len(small) > 1:
                if self._flat is None:
                    self._flat = _FlatGather()
                self._flat.run(small, pg)
                self._gather_each([g for g in group if g[3].nbytes >= _FLAT_MAX], pgs)
                for _, name, _, target in group:
                    yield name, target
                return
        self._gather_each(group, pgs)
        for _, name, _, target in group:
            yield name, target

    @torch.no_grad()
    def _gather_each(self, group: list[tuple[int, str, Any, torch.Tensor]], pgs: dict[int, Any]) -> None:
        """One all-gather per tensor, straight into its target: first every cast (fp32 ->
        wire), then the gathers back to back. Casting while NCCL runs makes them fight
        for the SMs, which costs NCCL more than the overlap saves."""
        if not group:
            return
        shards = [t.to_local().detach().to(target.dtype).contiguous() for _, _, t, target in group]
        pg = next(iter(pgs.values()))
        if config.flag("WEIGHTBUS_COALESCE_GATHERS") and len(pgs) == 1 and dist.get_backend(pg) == "nccl":
            # one fused NCCL launch for the whole group: measured 1.39x instead of 1.53x of
            # the all-gather floor (8B, 2xH200), but the trainer then held ~7.6 GB more
            # (about the whole bf16 half-model) until the update ended: opt-in
            from torch.distributed.distributed_c10d import _coalescing_manager
            with _coalescing_manager(group=pg, device=group[0][3].device, async_ops=True) as cm:
                for (_, _, _, target), shard in zip(group, shards, strict=True):
                    comm.all_gather_single(target, shard, group=pg)
            cm.wait()  # the stream waits (not the host): the next group's casts come after
        else:
            works = [comm.all_gather_single(target, shard, group=t.device_mesh.get_group(),
                                                 async_op=True)
                     for (_, _, t, target), shard in zip(group, shards, strict=True)]
            for w in works:
                w.wait()


_GROUP_BYTES = 256 << 20  # full-tensor bytes gathered per batch of casts
_FLAT_MAX = 64 << 20  # a tensor this large is gathered on its own: its call's cost is noise
_FLAT_ALIGN = 16


def _homes(weights: Any, items: Mapping[str, torch.Tensor]) -> dict[str, tuple[Any, str]]:
    """Where each of ``items`` lives, to be read again at each update: for a module, the
    ``_parameters`` or ``_buffers`` dict of its owning submodule and the attribute name
    (where the state dict's name resolves to the very same tensor). A mapping's tensors
    are held themselves: new memory given to one of them (``t.data = ...``) is followed
    with no check at all; an entry replaced in the mapping is not (no per-update pass
    over a mapping of 100k small tensors: 27 ms here)."""
    if not isinstance(weights, nn.Module):
        return {}
    live = weights.state_dict(keep_vars=True)
    out: dict[str, tuple[Any, str]] = {}
    for name, t in live.items():
        prefix, _, attr = name.rpartition(".")
        try:
            owner = weights.get_submodule(prefix) if prefix else weights
        except AttributeError:  # (a state-dict hook renamed it: held as it is)
            continue
        for table in (owner._parameters, owner._buffers):
            if table.get(attr) is t:
                out[name] = (table, attr)
    return out


def _split_of(t: Any) -> tuple[int, tuple[int, ...]] | None:
    """Where a DTensor's ranks each hold one contiguous range along one dim (``Shard(d)``
    on a 1-D mesh, as FSDP2 shards: torch.chunk's ranges, the last ones short or empty):
    ``(d, bounds)``; else None."""
    mesh = t.device_mesh
    if t.dim() == 0 or mesh.ndim != 1 or len(t.placements) != 1 or type(t.placements[0]) is not Shard:
        return None  # (a strided shard, as FSDP2 over TP makes, holds no one range)
    d, world = t.placements[0].dim % t.dim(), mesh.size()
    bounds = tuple(chunk_box(t.shape, d, s, world).start[d] for s in range(world)) + (t.shape[d],)
    me = mesh.get_local_rank()
    if _local(t).shape[d] != bounds[me + 1] - bounds[me]:
        return None  # (not torch.chunk's ranges)
    return d, bounds


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if _is_dtensor(t) else t  # type: ignore[attr-defined]


class _Live:
    """The tensors a source was built from, where they live: checked at each update in a
    few C-level passes (the objects by identity, their data pointers)."""

    def __init__(self, homes: list[tuple[Any, str] | None]):
        self.index = [i for i, h in enumerate(homes) if h is not None]
        self.tables = [homes[i][0] for i in self.index]  # type: ignore[index]
        self.keys = [homes[i][1] for i in self.index]  # type: ignore[index]
        self._objs: list[Any] = []
        self._ptrs = np.zeros(0, np.int64)
        self.seen()

    def _scan(self) -> tuple[list[Any], np.ndarray]:
        """The tensors now (None where one was removed) and their data pointers."""
        try:
            objs = list(map(operator.getitem, self.tables, self.keys))
        except KeyError:
            objs = list(map(_get, self.tables, self.keys))
        try:
            return objs, self._pointers(objs)
        except TypeError:  # (a removed one: None in its place, an empty stand-in for its pointer)
            return objs, self._pointers([o if o is not None else _NONE for o in objs])

    @staticmethod
    def _pointers(present: list[Any]) -> np.ndarray:
        return native.data_ptrs(present)  # (one C-level pass; a DTensor's: its shard's)

    def seen(self) -> None:
        """Take the tensors as they are now as the ones followed."""
        self._objs, self._ptrs = self._scan()

    def changed(self) -> list[tuple[int, torch.Tensor | None]]:
        """``(item index, tensor now)`` of every tensor replaced since :meth:`seen`: a new
        object, or new memory (what ``.data =`` gives; a tensor's shape is read only where
        one of these changed: ``.shape`` costs microseconds a tensor)."""
        objs, ptrs = self._scan()
        if all(map(operator.is_, objs, self._objs)) and np.array_equal(ptrs, self._ptrs):
            return []
        return [(self.index[k], objs[k]) for k in range(len(objs))
                if objs[k] is None or objs[k] is not self._objs[k] or ptrs[k] != self._ptrs[k]]


_NONE = torch.empty(0)


def _get(table: Any, key: str) -> Any:
    try:
        return table[key]
    except KeyError:
        return None


class _FlatGather:
    """A run of small dim-0-sharded tensors as ONE all-gather: every rank casts its shards
    into one flat buffer (a multi-tensor copy), the buffers are gathered rank-major, and
    each rank's rows are copied into the targets (another multi-tensor copy). One
    collective instead of one per tensor: at MoE scale (thousands of expert tensors) the
    per-call cost of NCCL, not the bytes, is what a gather per tensor pays. The buffers
    are held across updates and sized by the largest run (bounded by the run size plus
    ``_FLAT_MAX``); the views and copy lists of a run are made once."""

    def __init__(self) -> None:
        self._buf: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
        # per run of tensors: (flat in, flat out, typed views of flat in, scatter, its sources)
        self._runs: dict[tuple, tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], Any,
                                      list[torch.Tensor]]] = {}

    def _buffers(self, pg: Any, device: torch.device, seg: int, world: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        have = self._buf.get((id(pg), device))
        if have is None or have[0].numel() < seg:
            self._runs.clear()  # views of the old buffers
            self._buf.pop((id(pg), device), None)
            try:
                have = (torch.empty(seg, dtype=torch.uint8, device=device),
                        torch.empty(seg * world, dtype=torch.uint8, device=device))
            except (RuntimeError, MemoryError) as e:
                raise PlanError(f"cannot allocate {seg * (world + 1) / 2**20:.0f} MiB for the flat "
                                f"all-gather on {device} ({str(e).splitlines()[0][:160]})") from None
            self._buf[(id(pg), device)] = have
        return have

    @torch.no_grad()  # (to_local() is an autograd op otherwise: ~10 us a tensor)
    def run(self, group: list[tuple[int, str, Any, torch.Tensor]], pg: Any) -> None:
        from weightbus.packing.buffers import CopyList, copy_group

        world = dist.get_world_size(pg)
        me = dist.get_rank(pg)
        key = (id(pg), tuple((i, target.data_ptr()) for i, _, _, target in group))
        run = self._runs.get(key)
        if run is None:
            offsets, seg = [], 0
            for _, _, _, target in group:
                offsets.append(seg)
                seg += _aligned(target.nbytes // world)
            device = group[0][3].device
            flat_in, flat_out = self._buffers(pg, device, seg, world)
            ins, dsts, srcs, own = [], [], [], []
            for (_, _, _, target), off in zip(group, offsets, strict=True):
                rows = target.shape[0] // world  # views shaped like the local shards
                shard = (rows, *target.shape[1:])
                nb = target.nbytes // world
                ins.append(flat_in[off:off + nb].view(target.dtype).view(shard))
                whole = target.detach()
                for r in range(world):
                    if r == me:  # this rank's own rows: straight from its buffer
                        own.append(whole[r * rows:(r + 1) * rows])
                        continue
                    lo = r * seg + off
                    srcs.append(flat_out[lo:lo + nb].view(target.dtype).view(shard))
                    dsts.append(whole[r * rows:(r + 1) * rows])
            if len(self._runs) > 1024:
                self._runs.clear()
            run = self._runs[key] = (flat_in[:seg], flat_out[:seg * world], ins, CopyList(dsts + own),
                                     srcs + ins)
        flat_in, flat_out, ins, scatter, srcs = run
        copy_group(ins, [t.to_local() for _, _, t, _ in group])  # the cast
        comm.all_gather_single(flat_out, flat_in, group=pg)
        scatter.run(srcs)  # other ranks' rows from the gather, our own from our buffer


class _ToOwners:
    """A run of dim-0-sharded tensors, each wanted whole on ONE rank of their process group
    (the trainer that packs it), as one all-to-all: every rank casts its rows of them into
    one flat buffer ordered by the rank that wants them (one multi-tensor copy), the
    all-to-all hands each rank every other rank's rows of its tensors, and one more
    multi-tensor copy lays each out whole. A gather per tensor paid NCCL's per-call cost
    once per tensor: 1.6 s for the 9,435 tensors of a 30B MoE from 2 FSDP2 ranks (2 x H200).
    The flat buffers are kept across updates (each call's collective reads or fills them
    before the next call's copies, on the same stream); the whole tensors are new per call
    (the engine may hold them until it packs their bucket)."""

    def __init__(self) -> None:
        self._buf: dict[Any, torch.Tensor] = {}
        self._packs: dict[tuple, tuple[Any, ...]] = {}  # run (and its sources) -> its layout

    def _buffer(self, which: str, device: torch.device, nbytes: int) -> torch.Tensor:
        have = self._buf.get((which, device))
        if have is None or have.numel() < nbytes:
            self._packs.clear()  # (views of the old buffer)
            self._buf.pop((which, device), None)
            try:
                have = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            except (RuntimeError, MemoryError) as e:
                raise PlanError(f"cannot allocate {nbytes / 2**20:.0f} MiB for the all-to-all of sharded "
                                f"tensors on {device} ({str(e).splitlines()[0][:160]})") from None
            self._buf[(which, device)] = have
        return have[:nbytes]

    @torch.no_grad()
    def run(self, run: list[tuple[Any, torch.dtype, int]], pg: Any, first: int) -> list[torch.Tensor | None]:
        """``run``: (DTensor, wire dtype, the rank of ``pg`` that wants it whole), every
        tensor sharded over ``pg``, the first of them the source's tensor ``first``; returns
        the whole tensors in order, ``None`` for those another rank wants."""
        from weightbus.packing.buffers import CopyList, copy_group

        world, me = dist.get_world_size(pg), dist.get_rank(pg)
        locals_ = [t.to_local() for t, _, _ in run]
        device = locals_[0].device
        key = (id(pg), device, first, tuple((t.shape, wire, owner) for t, wire, owner in run))
        # the cast into the flat buffer is tabled for the sources it was made with: made again
        # (and the old ones let go) where a tensor now lives elsewhere
        ptrs = tuple(x.data_ptr() for x in locals_)
        plan = self._packs.get(key)
        if plan is None or plan[-1] != ptrs:
            # every rank's rows of each tensor: torch.chunk's split (ceil; the last short or empty)
            spans = []
            for t, wire, _ in run:
                n = t.shape[0]
                rows = -(-n // world) if n else 0
                row_bytes = math.prod(t.shape[1:]) * wire.itemsize
                spans.append([(min(n, r * rows), min(n, (r + 1) * rows), row_bytes) for r in range(world)])
            # what this rank sends: its rows of every tensor, grouped by the rank that wants it
            in_split, ins, pos = [0] * world, [], 0
            for d in range(world):
                for k, (_, _, owner) in enumerate(run):
                    lo, hi, rb = spans[k][me]
                    if owner == d and hi > lo:
                        ins.append((k, pos, (hi - lo) * rb))
                        pos += _aligned((hi - lo) * rb)
                        in_split[d] += _aligned((hi - lo) * rb)
            # what it gets: every rank's rows of the tensors it wants, in rank order
            out_split, pieces, pos = [0] * world, [], 0  # (tensor, first row, end row, offset)
            for s in range(world):
                for k, (_, _, owner) in enumerate(run):
                    lo, hi, rb = spans[k][s]
                    if owner == me and hi > lo:
                        pieces.append((k, lo, hi, pos))
                        pos += _aligned((hi - lo) * rb)
                        out_split[s] += _aligned((hi - lo) * rb)
            # the whole tensors it wants, one after another in one buffer per call
            wholes, pos = [], 0
            for t, wire, owner in run:
                wholes.append((pos, t.shape, wire) if owner == me else None)
                pos += _aligned(math.prod(t.shape) * wire.itemsize) if owner == me else 0
            wholes.append(pos)
            flat_in = self._buffer("in", device, sum(in_split))
            views = [flat_in[off:off + nb].view(run[k][1]).view(-1, *run[k][0].shape[1:])
                     for k, off, nb in ins]
            pack = CopyList(views, [locals_[k] for k, _, _ in ins]) if views else None
            plan = self._packs[key] = (pack, in_split, out_split, pieces, wholes, ptrs)
            if len(self._packs) > 1024:
                self._packs.clear()
        pack, in_split, out_split, pieces, wholes, _ = plan
        if pack is not None:
            pack.run()  # the cast, into the flat buffer
        flat_in = self._buffer("in", device, sum(in_split))
        flat_out = self._buffer("out", device, sum(out_split))
        dist.all_to_all_single(flat_out, flat_in, out_split, in_split, group=pg)
        flat = torch.empty(max(1, wholes[-1]), dtype=torch.uint8, device=device)
        fulls: list[torch.Tensor | None] = [
            None if w is None else flat[w[0]:w[0] + math.prod(w[1]) * w[2].itemsize].view(w[2]).view(w[1])
            for w in wholes[:-1]]
        dsts, srcs = [], []
        for k, lo, hi, off in pieces:  # (only the ranks that hold rows of it)
            part = fulls[k][lo:hi]  # type: ignore[index]
            dsts.append(part)
            srcs.append(flat_out[off:off + part.nbytes].view(part.dtype).view(part.shape))
        if dsts:
            copy_group(dsts, srcs)
        return fulls


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _FLAT_ALIGN) * _FLAT_ALIGN


@torch.no_grad()
def _fits_into(t: Any, target: torch.Tensor, wire: torch.dtype) -> bool:
    """Whether an even dim-0 shard gather can write straight into ``target``."""
    world = t.device_mesh.size()
    local = t.to_local()
    return (target.dtype == wire and tuple(target.shape) == tuple(t.shape) and target.is_contiguous()
            and t.shape[0] % world == 0 and local.shape[0] * world == t.shape[0]
            and target.device == local.device)


def _gatherable(t: Any) -> bool:
    mesh = t.device_mesh
    return mesh.ndim == 1 and len(t.placements) == 1 and t.placements[0] == Shard(0)


def _gather(t: Any, wire: torch.dtype, to: int | None) -> torch.Tensor | None:
    """Gather a dim-0 sharded DTensor to one rank of its mesh (``to``) or to all of them
    (``None``), cast to the wire dtype first so the gather moves (and the receiver
    holds) wire bytes only: half of fp32's for bf16."""
    group = t.device_mesh.get_group()
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    n = t.shape[0]
    rows = -(-n // world) if n else 0  # torch.chunk's split: ceil, last ranks short or empty
    local = t.to_local().detach()
    local = local.to(wire) if local.dtype != wire and local.is_floating_point() else local
    if local.shape[0] == rows:
        padded = local.contiguous()
    else:
        padded = local.new_zeros((rows, *t.shape[1:]))
        padded[: local.shape[0]].copy_(local)
    # every rank's real rows come first and in rank order (only the last ranks are short),
    # so the full tensor is the first n rows of the concatenation
    if to is None:
        full = padded.new_empty((world * rows, *t.shape[1:]))
        comm.all_gather_single(full, padded, group=group)
        return full[:n]
    pieces = [torch.empty_like(padded) for _ in range(world)] if me == to else None
    dist.gather(padded, pieces, dst=dist.get_global_rank(group, to), group=group)
    return torch.cat(pieces)[:n] if pieces is not None else None
