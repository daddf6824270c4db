"""Sharded updates: every rollout rank receives, point to point, only the regions of the
update tensors that its layout keeps (:mod:`weightbus.shards`), written straight into its
destinations; tensors its layout does not name arrive whole and are yielded as usual.

The rollout ranks state their layouts when the group forms (``set_shard_destinations``
before ``prepare()``); every rank then computes the same :class:`~weightbus.shards.ShardPlan`
per manifest. A sender packs the boxes of the tensors the plan gives it (cast into the
bucket), stamps each bucket's trailer as the broadcast path does, and sends it to its one
receiver; a receiver takes its buckets in the plan's order. Every sender walks its buckets
receiver by receiver and every receiver its buckets sender by sender, both orders
consistent with one global order of (receiver, sender, bucket): no cycle of waits.

A transport supports it with point-to-point hooks: ``_send`` and ``_post_recv`` /
``_wait_recv`` given a :class:`~weightbus.shards.ShardBucket` (``owner`` -> ``receiver``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from weightbus import buffers
from weightbus.engines.streams import Stream, StreamBroken, fetch
from weightbus.errors import PlanError, TransferFailed
from weightbus.plan import Manifest
from weightbus.shards import Box, ShardBucket, ShardLayout, ShardPlan

#: (the engine is a BucketEngine; typed loosely: bucket.py imports this module)
BucketEngine = Any

#: name -> the (region of the update tensor, destination view of that region's shape)
Placements = Mapping[str, Sequence[tuple[Box, torch.Tensor]]]


def check_placements(placements: Placements, where: str) -> ShardLayout:
    """The layout the placements announce; each destination must have its region's shape."""
    boxes: dict[str, list[Box]] = {}
    for name, pairs in placements.items():
        boxes[name] = []
        for box, dst in pairs:
            if not isinstance(box, Box) or not isinstance(dst, torch.Tensor):
                raise PlanError(f"{where}: placements of {name!r} must be (Box, tensor) pairs")
            if tuple(dst.shape) != box.size:
                raise PlanError(f"{where}: the destination of {name!r}{box} has shape {tuple(dst.shape)}, "
                                f"not the region's {box.size}")
            boxes[name].append(box)
    return ShardLayout(boxes)


def plan_of(engine: BucketEngine, manifest: Manifest) -> ShardPlan:
    key = (manifest.fingerprint, engine.bucket_size, engine.n_senders)
    plan = engine._shard_plans.get(key)
    if plan is None:
        plan = ShardPlan(manifest, engine._layouts, engine.bucket_size, engine.n_senders)  # type: ignore[arg-type]
        engine._shard_plans = {key: plan}
    return plan


# ------------------------------------------------------------------ sender

def send(engine: BucketEngine, manifest: Manifest, stream: Stream | None, version: int,
         error: str | None) -> tuple[str | None, int, int]:
    """Trainer rank: pack and send this rank's buckets; returns (error, bytes sent, buckets)."""
    try:
        plan = plan_of(engine, manifest)
    except PlanError as e:  # every rank computes the same plan: every rank fails here alike
        return error or f"{engine.where()}: sharded plan of version {version}: {e}", 0, 0
    rank = engine.rank_in_senders
    mine = plan.sent_by(rank)
    need = plan.tensors_of(rank)
    held: dict[int, torch.Tensor] = {}
    if stream is not None and error is None:
        metas = manifest.metas
        # the one rank that sends boxes of a tensor materialises it (a sharded source
        # gathers it there, collectively); a tensor nobody keeps, nowhere
        sent = set().union(*(plan.tensors_of(s) for s in range(engine.n_senders)))
        it = stream.open(plan, lambda i: frozenset([plan.senders[i]]) if i in sent else frozenset(), rank)
        try:
            for i, m in enumerate(metas):
                t = fetch(it, m, i, stream.strict_dtype)
                if i in need:
                    if t is None and m.nbytes:
                        raise PlanError(f"the weight source gave no data for {m.describe()} on the rank "
                                        f"that sends it")
                    held[i] = t  # type: ignore[assignment]
        except StreamBroken as e:
            error = f"{engine.where()}: the weight stream raised: {e.__cause__!r}"
        except Exception as e:  # noqa: BLE001 - reported to every rank at the end
            error = f"{engine.where()}: {e}"
    wire = 0
    down: str | None = None
    for b in mine:
        try:
            slot = engine._acquire(b)  # type: ignore[arg-type]
        except TransferFailed as e:
            down = down or str(e)
            continue
        if error is None:
            try:
                _pack(slot, b, manifest, held)
            except Exception as e:  # noqa: BLE001
                error = f"{engine.where()}: sharded bucket {b.index}: {e}"
        down = down or engine._ship(b, slot, version, error)
        wire += b.wire_bytes
    try:
        engine._flush_send(plan)  # type: ignore[arg-type]
    except TransferFailed as e:
        down = down or str(e)
    return error or down, wire, len(mine)


def _pack(slot: torch.Tensor, b: ShardBucket, manifest: Manifest, held: dict[int, torch.Tensor]) -> None:
    for p in b.pieces:
        m = manifest[p.tensor]
        dst = slot[p.offset:p.offset + p.nbytes].view(m.dtype).view(p.box.size)
        dst.copy_(p.box.of(held[p.tensor]))  # (cast to the wire dtype on the way)


# ------------------------------------------------------------------ receiver

def receive(engine: BucketEngine, start: float, version: int, manifest: Manifest, error: str | None,
            on_complete: Any, batched: bool) -> Iterator[Any]:
    """Rollout rank: take this rank's buckets; write placed regions into their
    destinations, yield the tensors this rank takes whole (assembled) when complete."""
    plan = None
    if error is None:
        try:
            plan = plan_of(engine, manifest)
        except PlanError as e:
            error = f"{engine.where()}: sharded plan of version {version}: {e}"
    mine = plan.received_by(engine.rank - engine.n_senders) if plan is not None else []
    places = _Places(engine._shard_dests or {}, manifest)
    closed = False
    wire = 0
    nb = engine.num_buffers
    try:
        for b in mine[:nb]:
            engine._post_recv(b)  # type: ignore[arg-type]
        for b in mine:
            slot = engine._wait_recv(b)  # type: ignore[arg-type]
            wire += b.wire_bytes
            status, msg = buffers.check_trailer(slot, b, version, engine.where())  # type: ignore[arg-type]
            if status != buffers.STATUS_OK and error is None:
                error = msg or f"{engine.where()}: sharded bucket {b.index} arrived with status {status}"
            if error is None and not closed:
                engine.version = None  # from the first byte written on, the old version is gone
                try:
                    done = places.unpack(slot, b)
                except Exception as e:  # noqa: BLE001 - this update's failure, everywhere
                    error = f"{engine.where()}: unpacking sharded bucket {b.index}: {e}"
                    done = []
                if done:
                    try:
                        if batched:
                            yield done
                        else:
                            yield from done
                    except GeneratorExit:
                        closed = True
                        error = (f"{engine.where()}: {engine._stopped()} at tensor {done[0][0]!r}; "
                                 f"the update is incomplete")
            if b.seq + nb < len(mine):
                engine._post_recv(mine[b.seq + nb])  # type: ignore[arg-type]
    except TransferFailed as e:
        error = error or str(e)
    r = engine.rank - engine.n_senders
    engine._sharded_got = (plan.bytes_for(r), plan.fallbacks[r]) if plan is not None else None
    try:
        engine._end_receive(start, version, manifest, error, closed, on_complete, wire, len(mine))
    finally:
        engine._sharded_got = None


class _Places:
    """Where each received piece lands: into the destination view of the region that
    holds it, or into a whole tensor being assembled (yielded once its last piece is in)."""

    def __init__(self, placements: Placements, manifest: Manifest):
        self.placements, self.manifest = placements, manifest
        self.whole: dict[int, tuple[torch.Tensor, int]] = {}  # tensor -> (assembling, elements left)

    def unpack(self, slot: torch.Tensor, b: ShardBucket) -> list[tuple[str, torch.Tensor]]:
        done = []
        for p in b.pieces:
            m = self.manifest[p.tensor]
            src = slot[p.offset:p.offset + p.nbytes].view(m.dtype).view(p.box.size)
            pairs = self.placements.get(m.name)
            if pairs is not None:
                box, dst = next((box, dst) for box, dst in pairs if _inside(p.box, box))
                dst[tuple(slice(a - o, a - o + n) for a, n, o in
                          zip(p.box.start, p.box.size, box.start, strict=True))].copy_(src)
                continue
            t, left = self.whole.get(p.tensor) or (torch.empty(m.shape, dtype=m.dtype, device=slot.device),
                                                   m.numel)
            p.box.of(t).copy_(src)
            left -= p.box.numel
            if left:
                self.whole[p.tensor] = (t, left)
            else:
                self.whole.pop(p.tensor, None)
                done.append((m.name, t))
        return done


def _inside(a: Box, b: Box) -> bool:
    return all(y <= x and x + n <= y + m for x, n, y, m in zip(a.start, a.size, b.start, b.size, strict=True))
