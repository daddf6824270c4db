"""Layer 4, trainer side: turn a model into the ``(name, tensor)`` stream engines send.

Name mapping and the dtype policy live here, not in engines. The source *declares* the
wire dtype in its manifest and hands over the tensors as they are; the engine's packer
casts while copying into the bucket, so the cast happens once, on the tensor's device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightbus import comm, config
from weightbus.errors import PlanError
from weightbus.plan import Manifest, TensorMeta, unsendable

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
    """

    def __init__(self, weights: nn.Module | Mapping[str, torch.Tensor], *,
                 dtype: torch.dtype | None = None, name_map: NameMap | None = None):
        items = weights.state_dict() if isinstance(weights, nn.Module) else dict(weights)
        self.dtype = dtype
        self._items: list[tuple[str, torch.Tensor]] = []
        metas = []
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
            metas.append(TensorMeta(out, self.wire_dtype(t), tuple(t.shape)))
        self.manifest = Manifest(metas)
        # Tensors with no autograd (a module's state dict) are held by reference: the list
        # an engine packs from is built once, and stays what the manifest was made from
        # (an optimizer updates them in place). Parameters are detached per update instead,
        # so that a swapped ``.data`` is followed.
        self._plain: list[torch.Tensor] | None = None
        if not any(_is_dtensor(t) or t.requires_grad for _, t in self._items):
            self._plain = [t for _, t in self._items]

    def wire_dtype(self, t: torch.Tensor) -> torch.dtype:
        # 8-bit floats (fp8 weights) are already a wire format: casting them up would double
        # their bytes and no longer match a rollout that holds them as fp8
        if self.dtype is not None and t.is_floating_point() and t.dtype.itemsize > 1:
            return self.dtype
        return t.dtype

    def __len__(self) -> int:
        return len(self._items)

    def plain_tensors(self) -> list[torch.Tensor] | None:
        """Every tensor in manifest order, when none is sharded (no DTensor): an engine
        then packs straight from this list, with no per-tensor step; None otherwise."""
        if self._plain is not None:
            return self._plain
        if any(_is_dtensor(t) for _, t in self._items):
            return None
        return [_detached(t) for _, t in self._items]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in self._items:
            yield name, t.full_tensor() if _is_dtensor(t) else _detached(t)

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
        group: list[tuple[int, str, Any, torch.Tensor]] = []  # gathers into targets, batched
        group_bytes = 0
        for i, (name, t) in enumerate(self._items):
            target = into(i) if into is not None and _is_dtensor(t) else None
            if target is not None and _gatherable(t) and len(owners(i)) == t.device_mesh.size() \
                    and _fits_into(t, target, self.wire_dtype(t)):
                group.append((i, name, t, target))
                group_bytes += target.numel() * target.element_size()
                if group_bytes >= _GROUP_BYTES:
                    yield from self._gather_group(group)
                    group, group_bytes = [], 0
                continue
            if group:
                yield from self._gather_group(group)
                group, group_bytes = [], 0
            if not _is_dtensor(t):
                yield name, _detached(t)
                continue
            need = owners(i)
            if len(need) == 1 and _gatherable(t):
                yield name, _gather(t, self.wire_dtype(t), to=next(iter(need)))
            elif len(need) == t.device_mesh.size() and _gatherable(t):
                yield name, _gather(t, self.wire_dtype(t), to=None)
            else:
                full = t.full_tensor()
                yield name, full if rank in need else None
        if group:
            yield from self._gather_group(group)

    def _gather_group(self, group: list[tuple[int, str, Any, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """All-gather a run of sharded tensors straight into their targets: first every
        cast (fp32 -> wire), then the gathers back to back. Casting while NCCL runs makes
        them fight for the SMs, which costs NCCL more than the overlap saves."""
        shards = [t.to_local().detach().to(target.dtype).contiguous() for _, _, t, target in group]
        pgs = {id(t.device_mesh.get_group()): t.device_mesh.get_group() for _, _, t, _ in group}
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
        for _, name, _, target in group:
            yield name, target


_GROUP_BYTES = 256 << 20  # full-tensor bytes gathered per batch of casts


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
