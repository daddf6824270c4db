"""Delta mode on sharded receive: each change lands, in the rollout rank's own coordinates,
on the rank that keeps it (issue 54).

A sharded group (:mod:`weightbus.engines.sharded`) moves the pieces of its
:class:`~weightbus.packing.shards.ShardPlan`: sender ``s`` sends receiver ``r`` the boxes of
the update tensors that ``r``'s layout keeps, cut at the senders' own rows where the
trainers are FSDP shards. With ``delta=True`` the plan stays the same and every piece is a
tensor of its own, flat in its box's order (the receiver's destination region, where the
region is contiguous):

- **Full update** (the first, a late joiner, a receiver that missed one, a new plan): the
  plan's dense buckets, as without delta; each sender keeps a copy of every piece it sent
  (its snapshot: the bytes of its own buckets, in the wire dtype), each receiver the
  running digest of every piece it holds.
- **Delta update**: each sender diffs every piece of its buckets against its snapshot and
  encodes the records of the package's format (:mod:`.encoding`; the record's tensor is
  the piece's number among its receiver's pieces, its range inside the piece). The
  records of a bucket go in that bucket, at the bucket's own size. The update goes in
  rounds of buckets (4 on GPUs, 1 on hosts): each round's sizes agreed in one
  all-reduce, then the same point-to-point transfers (and relay hops) as a dense update,
  patched while the senders diff the next round. A receiver applies them in place
  (:func:`.receiver._apply`: the digest of every record checked against its own old
  values), and checks the whole of its pieces every ``verify_every`` updates, as delta
  mode does.

So a receiver gets only the changes of what it keeps, from the rank that holds those rows,
and no rank gathers anything. A bucket whose records would not fit it (nearly every
element of many small pieces changed) goes dense on its own, every rank knowing it from
its round's all-reduce before a byte of it moves.

Destinations must be written in place: fixed placements (``set_shard_destinations`` with
a mapping, whose regions are views) and, for tensors a layout does not name,
``set_destinations``. A region that is not contiguous is staged (copied out, patched,
copied back).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from weightbus import config
from weightbus.engines import sharded
from weightbus.engines.delta.encoding import _MASK
from weightbus.engines.delta.protocol import Engine, _agree
from weightbus.engines.delta.receiver import WholeCheck, _apply, _Drift, _Targets, digests
from weightbus.engines.delta.sender import Block, Record, _read_digests, _records, part_elements, table_for
from weightbus.engines.delta.sender import _fill as fill_records
from weightbus.engines.streams import Stream
from weightbus.errors import PlanError, TransferFailed, WeightSyncError
from weightbus.packing import buffers, native
from weightbus.packing.buffers import CopyList
from weightbus.packing.shards import ShardBucket, ShardPlan
from weightbus.plan import TRAILER_BYTES, Manifest, TensorMeta

_NEUTRAL = -2  # (a bucket size another rank says)
_DENSE = -1  # (a bucket whose records would not fit it: sent dense, as in a full update)


class _Numbering:
    """The pieces of one plan as tensors of their own, worked out once per plan: for each
    bucket, the number of its first piece among its sender's pieces and among its
    receiver's (a relayed rank: its root's), and per side a manifest of the pieces (flat,
    wire dtype) that the record kernels read."""

    def __init__(self, plan: ShardPlan, sender: int | None, receiver: int | None, rounds: int):
        metas = plan.manifest.metas
        mine = plan.sent_by(sender) if sender is not None else []
        #: a sender's rounds of a delta update (its own buckets, by each one's position among
        #: its receiver's): each round's sizes are agreed, then its buckets move and are
        #: patched while the senders diff the next
        last = max((b.seq for b in mine), default=0) + 1
        rounds = max(1, min(rounds, last))
        self.round_of = {b.index: b.seq * rounds // last for b in mine}
        self.rounds: list[list[ShardBucket]] = [[] for _ in range(rounds)]
        for b in mine:
            self.rounds[self.round_of[b.index]].append(b)

        def numbered(buckets: list[ShardBucket], sending: bool) -> tuple[dict[int, int], Manifest]:
            first, pieces = {}, []
            for b in buckets:  # (a sender's pieces of one region for two receivers: two buckets)
                first[b.index] = len(pieces)
                tail = f" (bucket {b.index})" if sending else ""
                pieces += [TensorMeta(f"{metas[p.tensor].name}{p.box}{tail}", metas[p.tensor].dtype,
                                      (p.box.numel,)) for p in b.pieces]
            return first, Manifest(pieces)

        none: tuple[dict[int, int], Manifest] = ({}, Manifest([]))
        #: a sender's bucket -> the first of its buckets of the same round with the same
        #: pieces (replicas of one layout, fed direct, get the same buckets: diffed, and
        #: snapshotted, once)
        self.canon: dict[int, int] = {}
        seen: dict[tuple, int] = {}
        for b in mine:
            self.canon[b.index] = seen.setdefault((self.round_of[b.index], b.pieces), b.index)
        self.distinct = [b for b in mine if self.canon[b.index] == b.index]
        #: a sender's bucket -> the number of its first piece among its receiver's (the
        #: records' tensor numbers there)
        self.dest_first: dict[int, int] = {}
        for r in {b.receiver for b in mine}:
            n = 0
            for x in plan.received_by(r):
                self.dest_first[x.index] = n
                n += len(x.pieces)
        self.sent_first, self.sent = numbered(self.distinct, True) if sender is not None else none
        self.got_first, self.got = numbered(plan.received_by(receiver), False) if receiver is not None \
            else none


def _numbering(engine: Any, plan: ShardPlan) -> _Numbering:
    key = ("delta numbering",)
    got = engine._shard_copies.get(key)  # (cleared with the plan: sharded.plan_of)
    if got is None:
        sender = engine.rank_in_senders if engine.role == "trainer" else None
        receiver = engine.rank - engine.n_senders if engine.role == "rollout" else None
        # rounds of a delta update (``WEIGHTBUS_DELTA_ROUNDS``): the ranks patch one while the
        # senders diff the next. By default 4 where buckets are on a GPU, as broadcast delta;
        # 1 on hosts, where the diff and the patches share the cores (this 2-core box, 0.6b/2L,
        # TP=2 at 2%: 0.51-0.52x of the dense sharded update in one round, 0.63x in four)
        rounds = config.env_integer("WEIGHTBUS_DELTA_ROUNDS", minimum=1, maximum=1024) \
            or (4 if engine.device.type == "cuda" else 1)
        got = engine._shard_copies[key] = _Numbering(plan, sender, receiver, rounds)
    return got


def _key(engine: Any, manifest: Manifest, plan: ShardPlan | None) -> int:
    """What a snapshot or a receiver's pieces were made under (the same on every rank): the
    manifest, the buckets, and the layouts of the ranks the senders feed. A relayed rank
    takes its root's buckets, so a replica that joins or leaves below the roots (a leaf of
    a relay tree: one that joined from a live peer, ``join_from_peer``) changes nothing the
    others' pieces were numbered by, and the next update stays a delta."""
    fed = tuple((r, fp) for r, (fp, _) in enumerate(engine._layout_seen)
                if plan is None or plan.relay_from[r] is None)
    return hash((manifest.fingerprint, engine.bucket_size, engine.n_senders, fed)) & _MASK


def _agree_sizes(engine: Engine, plan: ShardPlan, mine: dict[int, int], more: bool
                 ) -> tuple[dict[int, ShardBucket], set[int], bool]:
    """One round: the buckets the senders put in it (index -> bucket), each at the size of
    its records (each sender says its own), or as the plan has it where the records would
    not fit (the second value: those, sent dense); and whether a sender has another round.
    The senders choose their rounds (their devices and settings may differ); receivers
    take each round as it comes."""
    sizes = torch.full((len(plan.buckets) + 1,), _NEUTRAL, dtype=torch.int64)
    for index, used in mine.items():
        sizes[index] = used
    sizes[-1] = int(more)
    engine._reduce_max(sizes, "delta: agreeing on the sharded buckets")
    said = sizes.tolist()
    dense = {i for i, used in enumerate(said[:-1]) if used == _DENSE}
    sized = {i: plan.buckets[i] if used == _DENSE else _resized(plan.buckets[i], used)
             for i, used in enumerate(said[:-1]) if used != _NEUTRAL}
    return sized, dense, said[-1] > 0


def _resized(b: ShardBucket, used: int, seq: int | None = None) -> ShardBucket:
    return ShardBucket(b.index, b.owner, b.receiver, b.pieces, used, b.turn, b.seq if seq is None else seq)


# ------------------------------------------------------------------ sender

def send(engine: Any, manifest: Manifest, stream: Stream | None, version: int,
         error: str | None) -> tuple[str | None, int, int]:
    """The trainer side of one update of a sharded group in delta mode (after the header
    and the layouts); returns (error, bytes moved, buckets), as ``BucketEngine._transfer``."""
    snaps = engine._snapshots
    plan, error = sharded.plan_or_error(engine, manifest, version, error)
    key = _key(engine, manifest, plan)
    held_version = snaps.version if snaps.fingerprint == key else None
    full = engine.last_full = not _agree(engine, held_version, None)
    snaps.version = None  # until this update completes
    if plan is None:
        return error, 0, 0
    numbers = _numbering(engine, plan)
    held, error = sharded.held_by(engine, plan, stream, error)
    capacity = engine.bucket_size - TRAILER_BYTES
    if full:
        if snaps.fingerprint != key:
            snaps.clear()  # (another plan's pieces)
        keep = _Keep(engine, plan, numbers, snaps, capacity, held) if error is None else None
        error, wire, n = sharded.send(engine, manifest, stream if error is None else None, version, error,
                                      packed=keep, held=held)
        engine._delta_pending = (version, key)
        return error, wire, n
    wire = 0
    down: str | None = None
    keep = _Keep(engine, plan, numbers, snaps, capacity, held)
    rounds, k, more = numbers.rounds, 0, True
    while more:  # (until no sender has a round left: each takes part in every agreement)
        ours = rounds[k] if k < len(rounds) else []
        made: dict[int, list[Record | Block]] = {}
        if error is None and ours:
            try:
                with torch.no_grad():
                    distinct = [b for b in ours if numbers.canon[b.index] == b.index]
                    made = _diff(engine, plan, numbers, distinct, held, snaps, capacity)
            except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                error = f"{engine.where()}: taking the delta of the weights: {e}"
        sizes = {}
        for b in ours:  # (after a failure: empty buckets, their trailers saying why)
            used = 8 + sum(it.size for it in made.get(numbers.canon[b.index], ()))
            sizes[b.index] = _DENSE if used > capacity else used
        sized, dense, more = _agree_sizes(engine, plan, sizes, k + 1 < len(rounds))
        k += 1
        for b0 in ours:
            b = sized[b0.index]
            try:
                slot = engine._acquire(b)
            except TransferFailed as e:
                down = down or str(e)
                continue
            if error is None:
                try:
                    if b.index in dense:  # (packed as a full update packs it, and kept)
                        sharded._tabled(engine, sharded._Pack, slot, b, plan).run(held)
                        keep(b, slot)
                    else:
                        canon = numbers.canon[b.index]
                        shift = numbers.sent_first[canon] - numbers.dest_first[b.index]
                        _fill(slot, made.get(canon, []), shift)
                except Exception as e:  # noqa: BLE001
                    error = f"{engine.where()}: filling delta bucket {b.index}: {e}"
            down = down or engine._ship(b, slot, version, error)
            wire += b.wire_bytes
    try:
        engine._flush_send(plan)
    except TransferFailed as e:
        down = down or str(e)
    engine._delta_pending = (version, key)
    return error or down, wire, len(plan.sent_by(engine.rank_in_senders))


def _diff(engine: Any, plan: ShardPlan, numbers: _Numbering, mine: list[ShardBucket], held: Any,
          snaps: Any, capacity: int) -> dict[int, list[Record | Block]]:
    """The records of every piece of ``mine`` (distinct buckets of one round), by bucket
    (index -> records)."""
    bucket_of = torch.empty(len(numbers.sent), dtype=torch.int64)
    for b in mine:
        first = numbers.sent_first[b.index]
        bucket_of[first:first + len(b.pieces)] = b.index
    out: dict[int, list[Record | Block]] = {}
    # the buckets' pieces (each bucket's list of views is the same object while its sources
    # stay where they were): the kernel calls of the last update replayed where they are
    views = [_cuts(engine, plan, b).sources(held) for b in mine]
    table = table_for(snaps, tuple(b.index for b in mine), views)
    pieces = ((numbers.sent_first[b.index] + j, 0, v) for b, vs in zip(mine, views, strict=True)
              for j, v in enumerate(vs))
    items = _read_digests(list(_records(pieces, numbers.sent, snaps, False, capacity - 8, table=table)))
    for it in items:
        if isinstance(it, Record):
            out.setdefault(int(bucket_of[it.head[0]]), []).append(it)
            continue
        where = bucket_of[it.heads[:, 0]]
        cuts = (where[1:] != where[:-1]).nonzero().squeeze(1).add(1).tolist()
        at = body = 0
        for end in [*cuts, len(where)]:  # (a kernel call's block may span buckets: split it)
            taken = sum(it.sizes[at:end])
            out.setdefault(int(where[at]), []).append(
                Block(it.heads[at:end], it.sizes[at:end], it.body[body:body + taken]))
            at, body = end, body + taken
    return out


def _fill(slot: torch.Tensor, items: list[Record | Block], shift: int) -> None:
    """A bucket of records whose tensors are numbered among the sender's pieces, written
    with the receiver's numbers (``shift`` apart: a bucket's pieces are consecutive in both)."""
    if shift:
        items = [_shifted(it, shift) for it in items]
    fill_records(slot, items)


def _shifted(it: Record | Block, shift: int) -> Record | Block:
    if isinstance(it, Record):
        return Record([it.head[0] - shift, *it.head[1:]], it.digest, it.body)
    heads = it.heads.clone()
    heads[:, 0] -= shift
    return Block(heads, it.sizes, it.body)


class _Keep:
    """A full update's ``packed`` hook: the snapshot of every piece of a packed bucket, on
    its source's device, in the parts the next delta diffs (``part_elements``)."""

    def __init__(self, engine: Any, plan: ShardPlan, numbers: _Numbering, snaps: Any, capacity: int,
                 held: Any):
        self.engine, self.plan, self.numbers, self.snaps = engine, plan, numbers, snaps
        self.capacity, self.held = capacity - 8, held
        self.metas = plan.manifest.metas

    def __call__(self, b: ShardBucket, slot: torch.Tensor) -> None:
        if self.numbers.canon[b.index] != b.index:  # (the same pieces as a bucket kept already)
            return
        first = self.numbers.sent_first[b.index]
        pieces = self.snaps.pieces
        for j, (p, source) in enumerate(zip(b.pieces, _cuts(self.engine, self.plan, b).sources(self.held),
                                            strict=True)):
            m = self.metas[p.tensor]
            flat = slot[p.offset:p.offset + p.nbytes].view(m.dtype)
            most = part_elements(m.itemsize, self.capacity, source.is_cpu)
            for lo in range(0, flat.numel(), most):
                part = flat[lo:lo + most]
                snap = pieces.get((first + j, lo))
                if snap is None or snap.numel() != part.numel() or snap.device != source.device:
                    snap = self.snaps.keep((first + j, lo), torch.empty(part.numel(), dtype=m.dtype,
                                                                        device=source.device))
                snap.copy_(part)


def _cuts(engine: Any, plan: ShardPlan, b: ShardBucket) -> sharded._Pack:
    """How bucket ``b``'s pieces are cut from their sources (made once per plan)."""
    key = ("delta cuts", b.index)
    cuts = engine._shard_copies.get(key)
    if cuts is None:
        cuts = engine._shard_copies[key] = sharded._Pack(None, b, plan)
    return cuts


# ------------------------------------------------------------------ receiver

class _Pieces:
    """A receiver's pieces as flat targets (made once per plan and destinations): each the
    view of its destination region, or a staging copy where the region is not contiguous
    (copied in before an update is applied, and back after)."""

    def __init__(self, engine: Any, plan: ShardPlan, numbers: _Numbering, r: int):
        dests, whole = engine._shard_dests, engine._dest or {}
        region = getattr(dests, "region", None)
        layout = engine._layouts[r]
        placed = layout.boxes if layout is not None else {}
        metas = plan.manifest.metas
        self.flat: list[torch.Tensor] = []
        self.staged: list[tuple[torch.Tensor, torch.Tensor]] = []  # (region view, its flat copy)
        for b in plan.received_by(r):
            for p in b.pieces:
                m = metas[p.tensor]
                if m.name in placed:
                    if region is None:
                        raise PlanError(f"delta mode writes each change in place: the destinations of "
                                        f"{m.name!r} must be views (fixed placements)")
                    view = region(m.name, p.box)
                elif m.name in whole:
                    view = p.box.of(whole[m.name])
                else:
                    raise PlanError(f"delta mode writes each change in place, but {m.describe()} (which this "
                                    f"rank's layout does not name) has no destination: set_destinations()")
                if view.dtype != m.dtype or tuple(view.shape) != p.box.size:
                    raise PlanError(f"the destination of {m.name!r}{p.box} is {view.dtype}"
                                    f"{list(view.shape)}, not the update's {m.dtype}{list(p.box.size)}")
                if view.is_contiguous():
                    self.flat.append(view.view(-1))
                else:
                    copy = view.contiguous().view(-1)
                    self.staged.append((view, copy))
                    self.flat.append(copy)
        self.targets = _Targets(self.flat)

    def stage_in(self) -> None:
        for view, copy in self.staged:
            copy.view(view.shape).copy_(view)

    def stage_out(self) -> None:
        for view, copy in self.staged:
            view.copy_(copy.view(view.shape))


def _pieces(engine: Any, plan: ShardPlan, numbers: _Numbering, r: int) -> _Pieces:
    """The receiver's targets, made again where a destination moved (its memory, under the
    same tensor object: ``param.data = ...``, ``set_``) or was set anew."""
    key = ("delta pieces",)
    dests, whole = engine._shard_dests, engine._dest or {}
    now = (dests.addresses() if callable(getattr(dests, "addresses", None)) else None,
           native.data_ptrs(list(whole.values())))
    got = engine._shard_copies.get(key)
    if got is not None and got[1] is engine._dest and got[2] is dests and got[3][0] == now[0] \
            and np.array_equal(got[3][1], now[1]):
        return got[0]
    pieces = _Pieces(engine, plan, numbers, r)
    engine._shard_copies[key] = (pieces, engine._dest, dests, now)
    return pieces


def receive(engine: Any, start: float, version: int, manifest: Manifest, error: str | None,
            on_complete: Any, batched: bool) -> Iterator[Any]:
    """The rollout side of one update of a sharded group in delta mode: every piece written
    in place (nothing is yielded: every tensor this rank keeps is where it lands)."""
    chain = engine._chain
    plan, error = sharded.plan_or_error(engine, manifest, version, error)
    key = _key(engine, manifest, plan)
    held = chain.version if engine.version == chain.version and chain.plan == key else None
    full = engine.last_full = not _agree(engine, held, chain.digest)
    chain.version = None
    if plan is None:
        engine._end_receive(start, version, manifest, error, False, on_complete, 0, 0)
        return
    r = engine.rank - engine.n_senders
    numbers = _numbering(engine, plan)
    pieces = None
    if error is None:
        try:
            pieces = _pieces(engine, plan, numbers, r)
        except PlanError as e:
            error = f"{engine.where()}: {e}"
    mine = plan.received_by(r)
    write = pieces is not None and error is None
    if write and not full:
        pieces.stage_in()
    check = WholeCheck(engine, chain, pieces.targets if write else [], full)
    moved = torch.zeros(len(numbers.got), dtype=torch.int64) if check.on and not full else None
    src, children, hop = plan.relay_from[r], plan.relay_to[r], plan.depth_of(r)
    wire = applied = 0
    nb = engine.num_buffers
    # a full update: every bucket dense, at once; a delta update: round by round, as the
    # senders choose them, each round's sizes agreed first (every rank takes part, also
    # after its transfers failed: the others would wait for it there until the deadline)
    dense: set[int] = set()
    more, broken, seq = True, False, 0
    while more:
        if full:
            group, more = mine, False
        else:
            sized, dense, more = _agree_sizes(engine, plan, {}, False)
            group = [sized[b.index] for b in mine if b.index in sized]
        # (each its place among this update's buckets here: the receive slots go by it)
        group = [_resized(b, b.used, seq + j) for j, b in enumerate(group)]
        seq += len(group)
        if broken:  # (nothing moves to or from here any more: the ranks below hear why)
            if children:
                sharded._abort_children(engine, group, children, hop + 1, version, error or "")
            continue
        done = 0
        try:
            for b in group[:nb]:
                engine._post_recv(b, src=src, hop=hop)
            for i, b in enumerate(group):
                slot = engine._wait_recv(b)
                for q in children:  # (before applying: the next hop starts at once)
                    engine._forward(b, slot, q, hop=hop + 1)
                done += 1
                wire += b.wire_bytes
                status, msg = buffers.check_trailer(slot, b, version, engine.where())
                if status != buffers.STATUS_OK and error is None:
                    error = msg or f"{engine.where()}: sharded bucket {b.index} arrived with status {status}"
                if error is None and write and not engine._refused:
                    engine.version = None  # from the first byte written on, the old version is gone
                    check.before_writes()
                    try:
                        with torch.no_grad():
                            applied += _land(engine, slot, b, numbers, pieces, full or b.index in dense,
                                             moved)
                    except _Drift as e:
                        error = f"{engine.where()}: {e}"
                    except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                        error = f"{engine.where()}: applying sharded bucket {b.index}: {e}"
                if i + nb < len(group):
                    engine._post_recv(group[i + nb], src=src, hop=hop)
            if children:
                engine._flush_forward()
        except TransferFailed as e:
            error, broken = error or str(e), True
            if children:
                sharded._abort_children(engine, group[done:], children, hop + 1, version, error)
        except WeightSyncError as e:
            if children:
                sharded._abort_children(engine, group[done:], children, hop + 1, version, str(e))
            raise
    if write and error is None:
        pieces.stage_out()
    error = check.finish(pieces.targets if write else [], numbers.got, version, moved, error)
    if error is None:
        chain.digest = ((version * 7919 + 1) if full else (chain.digest * 1000003 + version)) & _MASK
        chain.plan = key
        engine._delta_pending = (version, full)
    engine._sharded_got = (plan.bytes_for(r), plan.fallbacks[r])
    try:
        engine._end_receive(start, version, manifest, error, False, on_complete, wire, len(mine))
    finally:
        engine._sharded_got = None
    return
    yield  # (a generator: the consumer sees no tensor, every one is in place)


def _land(engine: Any, slot: torch.Tensor, b: ShardBucket, numbers: _Numbering, pieces: _Pieces,
          dense: bool, moved: torch.Tensor | None) -> int:
    """One bucket into this rank's pieces: its records patched (their digests' sum back),
    or, ``dense`` (a full update, or a bucket whose records would not fit it), copied; a
    dense bucket in a delta update moves its pieces' running digests by what it wrote."""
    if dense:
        first, last = numbers.got_first[b.index], numbers.got_first[b.index] + len(b.pieces)
        before = digests(pieces.flat[first:last]) if moved is not None else None
        _copies(engine, slot, b, numbers, pieces).run(None)
        if moved is not None:
            moved[first:last] += digests(pieces.flat[first:last]) - before
        return 0
    return _apply(slot, b.used, pieces.targets, numbers.got, False, moved)


def _copies(engine: Any, slot: torch.Tensor, b: ShardBucket, numbers: _Numbering, pieces: _Pieces
            ) -> CopyList:
    """A full update's bucket: each piece copied to its target (views made once per plan,
    slot and destinations)."""
    key = ("delta copies", b.index, slot.data_ptr(), id(pieces))
    got = engine._shard_copies.get(key)
    if got is None:
        metas, first = numbers.got.metas, numbers.got_first[b.index]
        srcs = [slot[p.offset:p.offset + p.nbytes].view(metas[first + j].dtype)
                for j, p in enumerate(b.pieces)]
        got = engine._shard_copies[key] = CopyList(pieces.flat[first:first + len(b.pieces)], srcs)
    return got


__all__ = ["receive", "send"]
