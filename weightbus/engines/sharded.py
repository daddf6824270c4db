"""Sharded updates: every rollout rank receives, point to point, only the regions of the
update tensors that its layout keeps (:mod:`weightbus.packing.shards`), written straight where
they land; tensors its layout does not name arrive whole and are yielded as usual.

A rollout rank states where its regions land as :class:`Destinations`
(``set_shard_destinations``): fixed placements (:class:`Placed`, from
``dtensor_placements`` or a shard spec), or an object that derives its layout from each
manifest (vLLM's loaders, recorded per manifest) and writes each region itself. The
group knows at formation that it shards; then, after every header, the ranks agree on
the rollout ranks' layouts (:func:`agree_layouts`: one small all-reduce of their
fingerprints; a layout's bytes travel only when it changed), and every rank computes
the same :class:`~weightbus.packing.shards.ShardPlan`. A sender packs the boxes of the tensors
the plan gives it (cast into the bucket), stamps each bucket's trailer as the broadcast
path does, and sends it to its one receiver; a receiver takes its buckets in the plan's
order. Senders take their receivers in turn and receivers their senders, both orders
consistent with one global order of (round, receiver, sender): no cycle of waits, and
every receiver unpacks while the others receive.

With ``relay=k`` (engine option), the rollout ranks of one layout form a tree
(:class:`~weightbus.packing.shards.ShardPlan`): the senders feed its root, and each member
forwards every bucket, as it arrives and before it unpacks it, to its children, which
check and unpack it as the root does. A member whose parent fails forwards abort notices
in its place, so the ranks below hear why at once, not at their deadline.

A transport supports it with point-to-point hooks: ``_send`` and ``_post_recv`` /
``_wait_recv`` given a :class:`~weightbus.packing.shards.ShardBucket` (``owner`` -> ``receiver``);
for relay, ``_post_recv(b, src=rollout rank, hop=d)``, ``_forward(b, slot, to, hop=d + 1)``
and ``_flush_forward()``, where ``d`` is the receiving rank's depth in its tree (a transport
may carry alternate hops over separate channels, so that a member's receive from its parent
and its forwards to its children run at once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
import torch

from weightbus.engines.streams import Stream, StreamBroken, fetch
from weightbus.errors import PlanError, TransferFailed, WeightSyncError
from weightbus.packing import buffers, native
from weightbus.packing.buffers import CopyList
from weightbus.packing.shards import Box, Piece, ShardBucket, ShardLayout, ShardPlan
from weightbus.plan import Manifest

#: (the engine is a BucketEngine; typed loosely: bucket.py imports this module)
BucketEngine = Any

#: name -> the (region of the update tensor, destination view of that region's shape)
Placements = Mapping[str, Sequence[tuple[Box, torch.Tensor]]]

_T = TypeVar("_T")
_NONE = -1  # a rollout rank without a layout (it takes every tensor whole)
_UNSAID = -(1 << 62)  # (all-reduce: a slot another rank fills)


@runtime_checkable
class Destinations(Protocol):
    """Where a rollout rank's sharded updates land."""

    def layout(self, manifest: Manifest) -> ShardLayout | None:
        """The regions this rank keeps of ``manifest``'s tensors (None: all whole). Called
        after every header, before any byte moves; it may change between updates."""

    def place(self, name: str, box: Box, data: torch.Tensor) -> None:
        """Write ``data`` (region ``box`` of update tensor ``name``, a view of a bucket:
        copy it before returning) where it lands. ``box`` lies inside one of the boxes
        :meth:`layout` stated for ``name``."""


class Placed:
    """Fixed destinations: each region written into its own destination view.

    Checked where they are given (every destination the shape of its region) and again
    before every update, on the rank that holds them, before any byte moves: each named
    tensor is in the update, each destination still has its region's shape and the
    update's wire dtype (a copy would cast silently). A destination re-allocated since
    (``param.data = ...``, ``model.to(...)``, a resize) is caught there; a mismatch fails
    the update on every rank (``layout`` raises: the group agrees on it before anything
    is written), naming the rank and the tensor, and the next update that fits lands.
    The check runs in full only where the manifest or a destination's memory changed
    (one C-level pass over the destinations otherwise)."""

    def __init__(self, placements: Placements, where: str | Callable[[], str]):
        self._where = where if callable(where) else (lambda: where)
        self.placements, self._layout = placements, check_placements(placements, self._where())
        self._dsts = [d for pairs in placements.values() for _, d in pairs]
        self._checked: tuple[int, np.ndarray, np.ndarray] | None = None  # (manifest, ptrs, numels)

    def layout(self, manifest: Manifest) -> ShardLayout:
        ptrs = self._pointers()
        numels = np.fromiter(map(torch.Tensor.numel, self._dsts), np.int64, len(self._dsts))
        seen = self._checked
        if seen is None or seen[0] != manifest.fingerprint or not np.array_equal(seen[1], ptrs) \
                or not np.array_equal(seen[2], numels):
            self._checked = None
            self.check(manifest)
            self._checked = (manifest.fingerprint, ptrs, numels)
        return self._layout

    def check(self, manifest: Manifest) -> None:
        """Raise :class:`PlanError` naming every destination that does not fit ``manifest``."""
        metas = {m.name: m for m in manifest}
        problems = []
        for name, pairs in self.placements.items():
            meta = metas.get(name)
            if meta is None:
                problems.append(f"a placement names tensor {name!r}, which the update does not have")
                continue
            for box, dst in pairs:
                what = f"the destination of {name!r}{list(box.start)}+{list(box.size)}"
                if tuple(dst.shape) != box.size:  # (a region outside its tensor: the plan says so)
                    problems.append(f"{what} now has shape {list(dst.shape)}, not the region's "
                                    f"{list(box.size)} (re-allocated since it was wired?)")
                elif dst.dtype != meta.dtype:
                    problems.append(f"{what} is {str(dst.dtype).removeprefix('torch.')}, the update sends "
                                    f"{str(meta.dtype).removeprefix('torch.')} (writing it would cast)")
        if problems:
            raise PlanError(f"{len(problems)} shard destination(s) do not fit the update, nothing was "
                            f"written: " + "; ".join(problems[:5])
                            + (f"; ... ({len(problems) - 5} more)" if len(problems) > 5 else ""))

    def _pointers(self) -> np.ndarray:
        return native.data_ptrs(self._dsts)

    def region(self, name: str, box: Box) -> torch.Tensor:
        """The destination view of ``box``. Destinations that have this method are fixed:
        a receiver tables the views once per plan and copies each bucket's pieces in one
        multi-tensor call (those without it get :meth:`place` per piece)."""
        outer, dst = next((b, d) for b, d in self.placements[name] if box.inside(b))
        return dst[box.within(outer)]

    def addresses(self) -> list[int]:
        """Where every destination's memory is now: a tensor's storage can be moved under
        the same tensor object (``param.data = ...``, ``set_``, a ``resize_``, a module
        that reallocates its weights), and the tabled views and addresses would then
        write where it no longer is. Read once per update."""
        return self._pointers().tolist()

    def place(self, name: str, box: Box, data: torch.Tensor) -> None:
        self.region(name, box).copy_(data)


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


def agree_layouts(engine: BucketEngine, manifest: Manifest, version: int, error: str | None) -> str | None:
    """Every rank, after the header of a sharded group: agree on every rollout rank's
    layout for this update (one all-reduce of their fingerprints and sizes; the bytes of
    a layout that changed since the last update, from its rank). A rollout rank whose
    layout cannot be made (or that failed before) keeps its last one; its error fails
    the update, and no rollout rank writes a byte of it. Returns the update's error."""
    T = engine.n_senders
    R = engine.world_size - T
    mine: ShardLayout | None = None
    r = engine.rank - T
    if engine.role == "rollout":
        kept = engine._layout_seen[r]
        mine = kept[1]
        if error is None and engine._shard_dests is not None:
            try:
                mine = engine._shard_dests.layout(manifest)
            except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                error = f"{engine.where()}: its shard layout for version {version}: {e}"
    raw = mine.to_bytes() if mine is not None else b""
    said = torch.full((2 * R + 1,), _UNSAID, dtype=torch.int64)
    if engine.role == "rollout":
        said[r], said[R + r] = (mine.fingerprint if mine is not None else _NONE), len(raw)
        said[2 * R] = 1 if error else 0
    engine._reduce_max(said, "header (shard layouts)")
    # a rollout rank that refused the update (its preflight) stops every other from
    # writing a byte of it: no replica is left half-updated by its peer's refusal
    engine._refused = bool(said[2 * R] > 0)
    for q in range(R):
        fp, n = int(said[q]), int(said[R + q])
        if engine._layout_seen[q][0] == fp:
            continue
        layout = None
        if fp != _NONE:
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if q == r else \
                torch.empty(n, dtype=torch.uint8)
            engine._broadcast_ctl(data, T + q, f"header (shard layout of rollout rank {q})")
            layout = mine if q == r else ShardLayout.from_bytes(bytes(data.numpy()))
        engine._layout_seen[q] = (fp, layout)
    engine._layouts = [lay for _, lay in engine._layout_seen]
    return error


def plan_or_error(engine: BucketEngine, manifest: Manifest, version: int, error: str | None
                  ) -> tuple[ShardPlan | None, str | None]:
    """The update's plan, or None and the update's error (every rank computes the same
    plan: every rank fails here alike)."""
    try:
        return plan_of(engine, manifest), error
    except PlanError as e:
        return None, error or f"{engine.where()}: sharded plan of version {version}: {e}"


def plan_of(engine: BucketEngine, manifest: Manifest) -> ShardPlan:
    said = tuple(fp for fp, _ in engine._layout_seen)
    key = (manifest.fingerprint, engine.bucket_size, engine.n_senders, said)
    plan = engine._shard_plans.get(key)
    if plan is None:
        plan = ShardPlan(manifest, engine._layouts, engine.bucket_size, engine.n_senders,  # type: ignore[arg-type]
                         getattr(engine, "relay", 0))
        engine._shard_plans = {key: plan}
        engine._shard_copies = {}  # (the tables of the plan before)
    return plan


def _tabled(engine: BucketEngine, kind: Callable[..., _T], slot: torch.Tensor, b: ShardBucket,
            *args: Any) -> _T:
    """What copying one bucket through one slot takes, made once per plan, slots and
    destinations (``plan_of``, ``_forget_views`` and ``set_shard_destinations`` clear the
    table): a MoE's buckets hold thousands of small pieces, whose views and copies made
    one by one per update cost more than their bytes (30b-a3b/24 from one trainer to 3 TP
    ranks on H100s: 558-611 ms so, 196-204 ms tabled, 97-108 ms to broadcast it all)."""
    key = (kind, b.index, slot.data_ptr())
    got = engine._shard_copies.get(key)
    if got is None:
        got = engine._shard_copies[key] = kind(slot, b, *args)
    return got


def _cut(box: Box, shape: tuple[int, ...]) -> tuple[int, int, int] | tuple[slice, ...] | None:
    """How a box is cut from its tensor: None (all of it), ``(dim, start, length)`` for a
    range along one dim (``narrow``: a third of indexing's cost), else its slices."""
    cut = [d for d, (a, n) in enumerate(zip(box.start, box.size, strict=True)) if a or n != shape[d]]
    if not cut:
        return None
    if len(cut) == 1:
        d = cut[0]
        return d, box.start[d], box.size[d]
    return box.slices


def _in_range(box: Box, shape: tuple[int, ...], dim: int, bounds: tuple[int, ...], sender: int
              ) -> tuple[Box, tuple[int, ...]]:
    """``box`` (inside ``sender``'s range of a split tensor) in the coordinates of that
    range, and the range's shape."""
    lo, hi = bounds[sender], bounds[sender + 1]
    start, size = list(box.start), list(shape)
    start[dim] -= lo
    size[dim] = hi - lo
    return Box(tuple(start), box.size), tuple(size)


class _Pack:
    """One sender bucket in one slot: the slot's views (made once) and how each piece is
    cut from its tensor; per update, one copy list (casts included) from the pieces' views
    of the source tensors. Those views are cut again only when a source tensor is not
    where and what it was at the last update (address, shape, strides, dtype, device:
    C-level passes over the bucket's tensors): a MoE bucket holds thousands of pieces, and
    cutting each anew per update, then checking it against its destination, cost more
    than its bytes (issue 52: 28,305 pieces of 30b-a3b at TP=3)."""

    def __init__(self, slot: torch.Tensor | None, b: ShardBucket, plan: ShardPlan):
        metas = plan.manifest.metas
        dsts = []
        self.cuts: list[tuple[int, Any]] = []
        for p in b.pieces:
            m = metas[p.tensor]
            if slot is not None:
                dsts.append(slot[p.offset:p.offset + p.nbytes].view(m.dtype).view(p.box.size))
            split = plan.split.get(p.tensor)  # (cut from the sender's own range of it)
            self.cuts.append((p.tensor, _cut(p.box, m.shape) if split is None
                              else _cut(*_in_range(p.box, m.shape, *split, b.owner))))
        self.names = [metas[p.tensor].name for p in b.pieces]
        self.tensors = list(dict.fromkeys(p.tensor for p in b.pieces))  # (each once, in order)
        self.copy = CopyList(dsts) if slot is not None else None  # (None: the views only, see sources)
        # the views cut at the last update, and what their sources were then (the views
        # hold those sources' memory: an address seen again is the same memory)
        self._srcs: list[torch.Tensor] = []
        self._seen: np.ndarray | None = None  # (native.layout_keys of the sources, last looked at)

    def run(self, held: Mapping[int, torch.Tensor] | Sequence[torch.Tensor]) -> None:
        assert self.copy is not None
        self.copy.run(self.sources(held), self.names.__getitem__)

    def sources(self, held: Mapping[int, torch.Tensor] | Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Each piece's view of its source tensor (in the source's dtype)."""
        tensors = list(map(held.__getitem__, self.tensors))
        seen = native.layout_keys(tensors)  # (addresses and a hash of the rest)
        last = self._seen
        if last is None or not np.array_equal(seen, last):
            srcs = []
            for i, cut in self.cuts:
                t = held[i]
                srcs.append(t if cut is None else t.narrow(*cut) if isinstance(cut[0], int) else t[cut])
            self._srcs = srcs
        self._seen = seen
        return self._srcs


# ------------------------------------------------------------------ sender

def _walk(plan: ShardPlan, stream: Stream, rank: int, n_senders: int
          ) -> dict[int, torch.Tensor] | list[torch.Tensor | None]:
    """The tensors sender ``rank`` sends boxes of: of a tensor the plan splits, this
    rank's own range (the source's :meth:`at_hand`, no communication); of the others, the
    whole tensor on the one rank that sends its boxes, walking the stream in manifest
    order (a sharded source gathers it there, collectively). Where no rank needs a tensor
    gathered, the stream is not walked: the source's list is packed from as it is."""
    need = plan.tensors_of(rank)
    at_hand = getattr(stream.source, "at_hand", None)
    hand = at_hand(rank) if at_hand is not None and plan.split else None
    if hand is not None and plan.all_at_hand(hand):
        return hand
    sent = set().union(*(plan.tensors_of(s) for s in range(n_senders))).difference(plan.split)
    it = stream.open(plan, lambda i: frozenset([plan.senders[i]]) if i in sent else frozenset(), rank)
    held: dict[int, torch.Tensor] = {}
    for i, m in enumerate(stream.manifest.metas):
        t = fetch(it, m, i, stream.strict_dtype)
        if i in need:
            if i in plan.split:
                if hand is None:
                    raise PlanError(f"the weight source splits {m.describe()} over the trainer ranks but "
                                    f"gives no rank its own range (at_hand)")
                t = hand[i]
            if t is None and m.nbytes:
                raise PlanError(f"the weight source gave no data for {m.describe()} on the rank "
                                f"that sends it")
            held[i] = t  # type: ignore[assignment]
    return held


def held_by(engine: BucketEngine, plan: ShardPlan, stream: Stream | None, error: str | None
            ) -> tuple[Mapping[int, torch.Tensor] | Sequence[torch.Tensor], str | None]:
    """What this sender packs from (tensor index -> tensor), and the update's error."""
    if stream is None or error is not None:
        return {}, error
    try:  # a source that holds every tensor hands them all: no step per tensor
        return engine._held_tensors(stream) or _walk(plan, stream, engine.rank_in_senders,
                                                     engine.n_senders), None
    except StreamBroken as e:
        return {}, f"{engine.where()}: the weight stream raised: {e.__cause__!r}"
    except Exception as e:  # noqa: BLE001 - reported to every rank at the end
        return {}, f"{engine.where()}: {e}"


def send(engine: BucketEngine, manifest: Manifest, stream: Stream | None, version: int,
         error: str | None, packed: Callable[[ShardBucket, torch.Tensor], None] | None = None,
         held: Mapping[int, torch.Tensor] | Sequence[torch.Tensor] | None = None
         ) -> tuple[str | None, int, int]:
    """Trainer rank: pack and send this rank's buckets; returns (error, bytes sent, buckets).
    ``packed(b, slot)``: called with each bucket packed, before it is sent (delta mode
    keeps what it sent); ``held``: what :func:`held_by` gave the caller (a stream is
    walked once per update)."""
    plan, error = plan_or_error(engine, manifest, version, error)
    if plan is None:
        return error, 0, 0
    mine = plan.sent_by(engine.rank_in_senders)
    if held is None:
        held, error = held_by(engine, plan, stream, error)
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
                _tabled(engine, _Pack, slot, b, plan).run(held)
                if packed is not None:
                    packed(b, slot)
            except Exception as e:  # noqa: BLE001
                error = f"{engine.where()}: sharded bucket {b.index}: {e}"
        down = down or engine._ship(b, slot, version, error)
        wire += b.wire_bytes
    try:
        engine._flush_send(plan)  # type: ignore[arg-type]
    except TransferFailed as e:
        down = down or str(e)
    return error or down, wire, len(mine)


# ------------------------------------------------------------------ receiver

def receive(engine: BucketEngine, start: float, version: int, manifest: Manifest, error: str | None,
            on_complete: Any, batched: bool) -> Iterator[Any]:
    """Rollout rank: take this rank's buckets; write placed regions into their
    destinations, yield the tensors this rank takes whole (assembled) when complete."""
    # (after a failure too: the senders send their buckets, as abort notices)
    plan, error = plan_or_error(engine, manifest, version, error)
    r = engine.rank - engine.n_senders
    mine = plan.received_by(r) if plan is not None else []
    layout = engine._layouts[r] if plan is not None else None
    src = plan.relay_from[r] if plan is not None else None
    children = plan.relay_to[r] if plan is not None else ()
    hop = plan.depth_of(r) if plan is not None else 0
    places = _Places(engine, layout, manifest)
    closed = False
    wire = 0
    nb = engine.num_buffers
    forwarded = 0  # (buckets passed on to the children)
    try:
        for b in mine[:nb]:
            engine._post_recv(b, src=src, hop=hop)  # type: ignore[arg-type]
        for b in mine:
            slot = engine._wait_recv(b)  # type: ignore[arg-type]
            for q in children:  # (before unpacking: the next hop starts at once)
                engine._forward(b, slot, q, hop=hop + 1)
            forwarded += 1
            wire += b.wire_bytes
            status, msg = buffers.check_trailer(slot, b, version, engine.where())  # type: ignore[arg-type]
            if status != buffers.STATUS_OK and error is None:
                error = msg or f"{engine.where()}: sharded bucket {b.index} arrived with status {status}"
            if error is None and not closed and not engine._refused:
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
                engine._post_recv(mine[b.seq + nb], src=src, hop=hop)  # type: ignore[arg-type]
        if children:
            engine._flush_forward()
    except TransferFailed as e:
        error = error or str(e)
        if children:
            _abort_children(engine, mine[forwarded:], children, hop + 1, version, error)
    except WeightSyncError as e:  # this rank's group broke: the ranks below hear it, then it raises
        if children:
            _abort_children(engine, mine[forwarded:], children, hop + 1, version, str(e))
        raise
    engine._sharded_got = (plan.bytes_for(r), plan.fallbacks[r]) if plan is not None else None
    try:
        engine._end_receive(start, version, manifest, error, closed, on_complete, wire, len(mine))
    finally:
        engine._sharded_got = None


def _abort_children(engine: BucketEngine, rest: Sequence[ShardBucket], children: Sequence[int], hop: int,
                    version: int, error: str) -> None:
    """This relay member's transfers failed before ``rest[0]``: its children get an abort
    notice for every bucket they still wait for from it, naming why (best effort: a child
    this rank cannot reach either fails at its own deadline)."""
    notice = torch.zeros(engine.bucket_size, dtype=torch.uint8, device=engine.device)
    try:
        for b in rest:
            buffers.write_trailer(notice, b, version, buffers.STATUS_ABORT,  # type: ignore[arg-type]
                                  f"relayed: {error}")
            for q in children:
                engine._forward(b, notice, q, hop=hop, abort=True)
            engine._flush_forward(abort=True)
    except Exception:  # noqa: BLE001 - already failing; the children's deadline remains
        pass


class _Unpack:
    """One receiver bucket in one slot: the pieces whose destinations are fixed (a
    :meth:`Placed.region`) as one copy list of views made once; the others, with their
    slot views, for a destination's ``place`` or a whole tensor being assembled."""

    def __init__(self, slot: torch.Tensor, b: ShardBucket, manifest: Manifest, dests: Destinations | None,
                 placed: Mapping[str, Any]):
        region = getattr(dests, "region", None)
        dsts, srcs, names = [], [], []
        self.rest: list[tuple[Piece, torch.Tensor]] = []
        for p in b.pieces:
            m = manifest[p.tensor]
            src = slot[p.offset:p.offset + p.nbytes].view(m.dtype).view(p.box.size)
            if region is not None and m.name in placed:
                dsts.append(region(m.name, p.box))
                srcs.append(src)
                names.append(m.name)
            else:
                self.rest.append((p, src))
        self.names = names
        self.copy = CopyList(dsts, srcs) if dsts else None


class _Places:
    """Where each received piece lands: where the destinations put the region that holds
    it, or into a whole tensor being assembled (yielded once its last piece is in)."""

    def __init__(self, engine: BucketEngine, layout: ShardLayout | None, manifest: Manifest):
        self.engine, self.manifest = engine, manifest
        self.dests = dests = engine._shard_dests
        now = dests.addresses() if isinstance(dests, Placed) else None
        if now != engine._shard_seen:  # (moved since the views were tabled: table them anew)
            engine._shard_copies, engine._shard_seen = {}, now
        self.placed = layout.boxes if layout is not None and dests is not None else {}
        self.whole: dict[int, tuple[torch.Tensor, int]] = {}  # tensor -> (assembling, elements left)

    def unpack(self, slot: torch.Tensor, b: ShardBucket) -> list[tuple[str, torch.Tensor]]:
        # (set_shard_destinations clears the tables: they hold views of the destinations)
        prog = _tabled(self.engine, _Unpack, slot, b, self.manifest, self.dests, self.placed)
        if prog.copy is not None:
            prog.copy.run(None, prog.names.__getitem__)
        done = []
        for p, src in prog.rest:
            m = self.manifest[p.tensor]
            if m.name in self.placed:
                self.dests.place(m.name, p.box, src)  # type: ignore[union-attr]
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

