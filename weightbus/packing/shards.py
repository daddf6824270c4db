"""Sharded receive, the pure part: which regions of which update tensors each rollout rank
keeps, and the static schedule that moves exactly those bytes, point to point.

A rollout rank under tensor (or expert) parallelism keeps only part of most tensors: a row
or column slice, its experts, the q, k and v pieces of a fused parameter, a vocab slice.
It states that as a :class:`ShardLayout` (update-tensor name -> the :class:`Box` regions it
keeps). :class:`ShardPlan` is a deterministic function of the manifest, every rollout
rank's layout, the bucket size and the sender count, so every rank computes the same plan
and per-bucket metadata never travels (as with :class:`~weightbus.plan.BucketPlan`):

- each tensor is sent by one trainer rank (balanced by the bytes wanted of it, among the
  ranks that hold it: :attr:`Manifest.homes`), so no tensor is gathered on two ranks;
- for every (sender, receiver) pair the wanted boxes are packed in manifest order into
  buckets of ``bucket_size`` bytes (a box larger than a bucket is cut into smaller boxes
  along its leading dimensions), each piece at an aligned offset; a sender sends to its
  receivers in turn, bucket by bucket (round-robin), so they all unpack at once;
- a receiver gets each box it wants exactly once, and nothing else;
- with ``relay=k``, the rollout ranks of one layout (rank r of every replica of one
  parallelism) form a k-ary tree in rank order: only its root is sent buckets, and every
  member forwards each bucket it receives, as it arrives, to its children (k=1: a chain).
  The senders' links then carry each shard once per layout, not once per replica.

A tensor a layout does not name is wanted whole (the rank's fallback: its sink loads whole
tensors); one it maps to no box is not wanted at all.
"""

from __future__ import annotations

import functools
import hashlib
import heapq
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

from weightbus.errors import PlanError
from weightbus.plan import ALIGNMENT, TRAILER_BYTES, Framed, Manifest, _align


@dataclass(frozen=True)
class Box:
    """A rectangular region of a tensor: ``start`` and ``size`` along every dimension
    (a 0-d tensor's only box has both empty)."""

    start: tuple[int, ...]
    size: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        if cls is Box:  # (boxes are immutable: one per shape is shared)
            return _whole(tuple(shape))
        return cls((0,) * len(shape), tuple(int(s) for s in shape))

    @classmethod
    def rows(cls, shape: Sequence[int], begin: int, end: int, dim: int = 0) -> Box:
        """Indices ``begin:end`` along ``dim``, everything along the other dimensions."""
        start = [0] * len(shape)
        size = [int(s) for s in shape]
        start[dim], size[dim] = begin, end - begin
        return cls(tuple(start), tuple(size))

    @functools.cached_property
    def numel(self) -> int:
        return prod(self.size)

    @property
    def slices(self) -> tuple[slice, ...]:
        return tuple(slice(a, a + n) for a, n in zip(self.start, self.size, strict=True))

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This region of ``t`` (a view)."""
        return t[self.slices]

    def fits(self, shape: Sequence[int]) -> bool:
        """Whether this box lies inside a tensor of ``shape``."""
        return len(self.start) == len(shape) == len(self.size) and all(
            a >= 0 and n >= 0 and a + n <= s for a, n, s in zip(self.start, self.size, shape, strict=True))

    def check(self, shape: Sequence[int], what: str) -> None:
        """Raise :class:`PlanError` unless this box lies inside a tensor of ``shape``."""
        if not self.fits(shape):
            raise PlanError(f"{what}: region {self} does not fit a tensor of shape {tuple(shape)}")

    def split(self, max_numel: int) -> list[Box]:
        """Cut into boxes of at most ``max_numel`` elements (at least one element each),
        in row-major order, along the leading dimensions first."""
        if self.numel <= max_numel or not self.size:
            return [self]
        d = next(i for i, n in enumerate(self.size) if n > 1)
        inner = prod(self.size[d + 1:])
        if inner <= max_numel:  # whole slabs along dim d
            step = max(1, max_numel // inner)
            return [self._along(d, a, min(step, self.size[d] - a)) for a in range(0, self.size[d], step)]
        return [b for a in range(self.size[d]) for b in self._along(d, a, 1).split(max_numel)]

    def overlaps(self, other: Box) -> bool:
        return all(x < y + m and y < x + n
                   for x, n, y, m in zip(self.start, self.size, other.start, other.size, strict=True))

    def inside(self, outer: Box) -> bool:
        return all(y <= x and x + n <= y + m
                   for x, n, y, m in zip(self.start, self.size, outer.start, outer.size, strict=True))

    def intersect(self, other: Box) -> Box | None:
        """The region both boxes hold (None: they hold none in common)."""
        start = tuple(max(x, y) for x, y in zip(self.start, other.start, strict=True))
        end = tuple(min(x + n, y + m)
                    for x, n, y, m in zip(self.start, self.size, other.start, other.size, strict=True))
        if self.size and any(e <= a for a, e in zip(start, end, strict=True)):
            return None
        return Box(start, tuple(e - a for a, e in zip(start, end, strict=True)))

    def within(self, outer: Box) -> tuple[slice, ...]:
        """This box's slices in the coordinates of ``outer`` (which contains it)."""
        return tuple(slice(a - o, a - o + n)
                     for a, n, o in zip(self.start, self.size, outer.start, strict=True))

    def _along(self, d: int, offset: int, n: int) -> Box:
        start, size = list(self.start), list(self.size)
        start[d] += offset
        size[d] = n
        return Box(tuple(start), tuple(size))

    def __str__(self) -> str:
        return "[" + ", ".join(f"{a}:{a + n}" for a, n in zip(self.start, self.size, strict=True)) + "]"


@functools.lru_cache(maxsize=1 << 16)
def _whole(shape: tuple[int, ...]) -> Box:
    """The whole box of ``shape``: a plan asks for it once per rank and tensor its layout
    leaves whole (a trillion-parameter MoE's 16 ranks: a million times)."""
    return Box((0,) * len(shape), tuple(int(s) for s in shape))


class ShardLayout:
    """What one rollout rank keeps of an update: tensor name -> the boxes it keeps.
    A name not listed is wanted whole; one mapped to no box is not wanted. Fixed once
    made: its bytes and fingerprint are worked out once (every update states its layout:
    a pass over its boxes per update would be work per tensor)."""

    def __init__(self, boxes: Mapping[str, Sequence[Box]]):
        self.boxes: dict[str, tuple[Box, ...]] = {n: tuple(bs) for n, bs in boxes.items()}

    def wants(self, manifest: Manifest, rank: int) -> list[tuple[int, Box]]:
        """(tensor index, box) for every region this rank keeps of ``manifest``, checked;
        overlapping boxes of one tensor are refused (a receiver writes each element once).
        (Once per plan, but per tensor and rank: a trillion-parameter MoE's 139,523 tensors
        on 16 ranks, so the common cases take no step they do not need.)"""
        out: list[tuple[int, Box]] = []
        listed = self.boxes.get
        for i, m in enumerate(manifest.metas):
            boxes = listed(m.name)
            if boxes is None:
                out.append((i, Box.whole(m.shape)))
                continue
            if not boxes:  # (not wanted)
                continue
            for b in boxes:
                if not b.fits(m.shape):
                    b.check(m.shape, f"rollout rank {rank}, tensor {m.name!r}")
            for j, a in enumerate(boxes[:-1]):
                for b in boxes[j + 1:]:
                    if a.overlaps(b):
                        raise PlanError(f"rollout rank {rank}, tensor {m.name!r}: regions {a} and {b} "
                                        f"overlap (each element is received once)")
            out.extend((i, b) for b in boxes if b.numel)
        return out

    def to_bytes(self) -> bytes:
        return self._raw

    @functools.cached_property
    def _raw(self) -> bytes:
        parts = [struct.pack("<I", len(self.boxes))]
        for name, boxes in self.boxes.items():
            raw = name.encode()
            parts.append(struct.pack("<II", len(raw), len(boxes)) + raw)
            for b in boxes:
                parts.append(struct.pack(f"<I{2 * len(b.start)}q", len(b.start), *b.start, *b.size))
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> ShardLayout:
        (n,), pos = struct.unpack_from("<I", data), 4
        boxes: dict[str, list[Box]] = {}
        for _ in range(n):
            ln, nb = struct.unpack_from("<II", data, pos)
            pos += 8
            name = data[pos:pos + ln].decode()
            pos += ln
            boxes[name] = []
            for _ in range(nb):
                (dims,) = struct.unpack_from("<I", data, pos)
                vals = struct.unpack_from(f"<{2 * dims}q", data, pos + 4)
                pos += 4 + 16 * dims
                boxes[name].append(Box(tuple(vals[:dims]), tuple(vals[dims:])))
        return cls(boxes)

    @functools.cached_property
    def fingerprint(self) -> int:
        return int.from_bytes(hashlib.blake2b(self.to_bytes(), digest_size=8).digest(), "little") >> 1


def _by_tensor(item: tuple[int, Box, int]) -> int:
    return item[0]


def _pack(items: list[tuple[int, Box, int]], capacity: int) -> Iterator[tuple[tuple[Piece, ...], int]]:
    """(pieces, used bytes) of each bucket that (tensor, box, itemsize) items fill in order,
    a box cut where it does not fit one bucket."""
    pieces: list[Piece] = []
    used = 0
    for i, box, item in items:
        for part in box.split(max(1, capacity // item)):
            nbytes = part.numel * item
            off = _align(used)
            if pieces and off + nbytes > capacity:
                yield tuple(pieces), used
                pieces, off = [], 0
            pieces.append(Piece(i, part, off, nbytes))
            used = off + nbytes
    if pieces:
        yield tuple(pieces), used


@dataclass(frozen=True)
class Piece:
    """One box of one tensor at ``offset`` bytes into its bucket."""

    tensor: int
    box: Box
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ShardBucket(Framed):
    """The bytes one sender moves to one receiver in one message."""

    index: int  # position in the plan
    owner: int  # the trainer rank that packs and sends it
    receiver: int  # the rollout rank (0..R-1) it goes to (relayed: the root of its tree)
    pieces: tuple[Piece, ...]
    used: int
    turn: int  # its position among its sender's buckets (senders cycle their slots by it)
    seq: int  # its position among its receiver's buckets


class ShardPlan:
    """The static schedule of a sharded update (see the module doc). ``layouts`` has one
    entry per rollout rank (None: that rank takes every tensor whole)."""

    def __init__(self, manifest: Manifest, layouts: Sequence[ShardLayout | None], bucket_size: int,
                 n_senders: int, relay: int = 0):
        if n_senders < 1:
            raise PlanError(f"n_senders must be >= 1, got {n_senders}")
        if relay < 0:
            raise PlanError(f"relay must be >= 0 (0: no relay, 1: a chain, k: a k-ary tree), got {relay}")
        capacity = (bucket_size - TRAILER_BYTES) // 8 * 8
        if capacity < ALIGNMENT:
            raise PlanError(f"bucket_size={bucket_size} is too small for a sharded update "
                            f"(minimum {ALIGNMENT + TRAILER_BYTES})")
        self.manifest, self.bucket_size, self.n_senders = manifest, bucket_size, n_senders
        metas = manifest.metas
        R = len(layouts)
        #: relay: the rollout rank each rank's buckets come from (None: from the senders)
        #: and those it forwards them to
        self.relay_from: list[int | None] = [None] * R
        self.relay_to: list[tuple[int, ...]] = [()] * R
        self.relay = relay
        if relay:
            same: dict[bytes | None, list[int]] = {}
            for r, layout in enumerate(layouts):
                same.setdefault(layout.to_bytes() if layout is not None else None, []).append(r)
            for members in same.values():
                for j, q in enumerate(members[1:], 1):
                    parent = members[(j - 1) // relay]
                    self.relay_from[q] = parent
                    self.relay_to[parent] += (q,)
        roots = [r if self.relay_from[r] is None else self.root(r) for r in range(R)]
        wants = [(layout or ShardLayout({})).wants(manifest, r) if roots[r] == r else []
                 for r, layout in enumerate(layouts)]
        #: per rollout rank, how many tensors it takes whole because its layout does not
        #: name them (its sink loads those whole: the fallback)
        self.fallbacks = [sum(1 for m in metas if layout is None or m.name not in layout.boxes)
                          for layout in layouts]
        #: the tensors whose every sender holds its own range (the manifest's splits over
        #: exactly these senders): each sends the receivers' pieces of its range, so none
        #: is gathered; tensor -> (dim, bounds)
        self.split: dict[int, tuple[int, tuple[int, ...]]] = {
            i: x for i, x in enumerate(manifest.splits or ()) if x is not None and len(x[1]) == n_senders + 1}
        wanted = [0] * len(metas)
        load = [0] * n_senders  # (bytes each sender sends of its ranges: whole tensors go round them)
        items: dict[tuple[int, int], list[tuple[int, Box, int]]] = {
            (r, s): [] for r in range(len(wants)) for s in range(n_senders)}
        for r, w in enumerate(wants):
            for i, b in w:
                nbytes = b.numel * metas[i].dtype.itemsize
                x = self.split.get(i)
                if x is None:
                    wanted[i] += nbytes
                    continue
                for s, part in self._parts(b, *x):
                    items[(r, s)].append((i, part, metas[i].dtype.itemsize))
                    load[s] += part.numel * metas[i].dtype.itemsize
        self.senders = self._senders(manifest, wanted, n_senders, load, self.split)
        for r, w in enumerate(wants):  # (the whole tensors, in order among the pieces of ranges)
            for i, b in w:
                if i not in self.split:
                    items[(r, self.senders[i])].append((i, b, metas[i].dtype.itemsize))
        # the buckets of every (sender, receiver) pair, then all of them in one global
        # order: round j (a pair's j-th bucket), receiver, sender. A sender takes its
        # receivers in turn (they unpack at once, not one after another) and a receiver
        # its senders in turn; both orders agree with the global one: no cycle of waits.
        pairs = {key: list(_pack(sorted(its, key=_by_tensor) if self.split else its, capacity))
                 for key, its in items.items()}
        order = sorted((j, r, s) for (r, s), packed in pairs.items() for j in range(len(packed)))
        buckets: list[ShardBucket] = []
        turns, seqs = [0] * n_senders, [0] * len(wants)
        for j, r, s in order:
            pieces, used = pairs[(r, s)][j]
            buckets.append(ShardBucket(len(buckets), s, r, pieces, used, turns[s], seqs[r]))
            turns[s], seqs[r] = turns[s] + 1, seqs[r] + 1
        self.buckets: tuple[ShardBucket, ...] = tuple(buckets)
        self._sent = [[b for b in buckets if b.owner == s] for s in range(n_senders)]
        got = [[b for b in buckets if b.receiver == r] for r in range(R)]
        self._got = [got[roots[r]] for r in range(R)]  # (a relayed rank: its root's buckets)
        self._holds = [{p.tensor for b in sent for p in b.pieces} for sent in self._sent]
        self._bytes = [sum(p.nbytes for b in got for p in b.pieces) for got in self._got]
        self._hand_checked: tuple[object, bool] | None = None

    @staticmethod
    def _parts(box: Box, dim: int, bounds: tuple[int, ...]) -> Iterator[tuple[int, Box]]:
        """(sender, the part of ``box`` in its range) for each sender whose range meets it.
        A box of no elements (a tensor of size 0, wanted whole) is one part: its receiver
        hears of it once, as with one sender."""
        a, e = box.start[dim], box.start[dim] + box.size[dim]
        empty = not box.numel
        for s in range(len(bounds) - 1):
            lo, hi = max(a, bounds[s]), min(e, bounds[s + 1])
            if lo < hi:
                yield s, box if (lo, hi) == (a, e) else box._along(dim, lo - a, hi - lo)
                if empty:
                    return
        if empty:  # (no rows along the split dim: sender 0's range is as empty)
            yield 0, box

    @staticmethod
    def _senders(manifest: Manifest, wanted: list[int], n: int, load: list[int] | None = None,
                 split: Mapping[int, object] = {}) -> list[int]:  # noqa: B006 - (read only)
        """One sender per tensor: the least loaded (by bytes wanted, over ``load`` to start)
        of those holding it, the largest tensors placed first; ties go to the lowest rank.
        (A tensor whose senders each send their own range, in ``split``: rank 0, unused.)"""
        homes = manifest.homes if n > 1 else None
        load, out = list(load or [0] * n), [0] * len(wanted)
        order = sorted((i for i in range(len(wanted)) if i not in split), key=lambda i: (-wanted[i], i))
        if homes is None or all(h is None for h in homes):
            # every rank holds every tensor: the least loaded is the heap's top (the same
            # choice as the scan below, in log n: 140k tensors x 256 senders took 14 s)
            heap = [(load[r], r) for r in range(n)]
            heapq.heapify(heap)
            for i in order:
                w, s = heapq.heappop(heap)
                out[i] = s
                heapq.heappush(heap, (w + wanted[i], s))
            return out
        for i in order:
            held = sorted(homes[i]) if homes[i] is not None else range(n)  # type: ignore[index]
            held = [h for h in held if h < n]
            if not held:
                raise PlanError(f"tensor {manifest[i].name!r} is held by no sender rank below {n}")
            s = min(held, key=lambda h: (load[h], h))
            out[i] = s
            load[s] += wanted[i]
        return out

    def root(self, receiver: int) -> int:
        """The rank of ``receiver``'s relay tree that the senders feed (itself, unrelayed)."""
        while (up := self.relay_from[receiver]) is not None:
            receiver = up
        return receiver

    def depth_of(self, receiver: int) -> int:
        """Hops from ``receiver``'s root down to it (0: the senders feed it)."""
        d = 0
        while (up := self.relay_from[receiver]) is not None:
            receiver, d = up, d + 1
        return d

    @property
    def relay_depth(self) -> int:
        """Hops of the longest relay path (0: every rank is fed by the senders)."""
        return max((self.depth_of(r) for r in range(len(self.relay_from))), default=0)

    def sent_by(self, sender: int) -> list[ShardBucket]:
        return self._sent[sender]

    def received_by(self, receiver: int) -> list[ShardBucket]:
        return self._got[receiver]

    def bytes_for(self, receiver: int) -> int:
        """Payload bytes rollout rank ``receiver`` receives (no trailers)."""
        return self._bytes[receiver]

    def tensors_of(self, sender: int) -> set[int]:
        """The tensors ``sender`` must hold (it sends boxes of them; of a tensor in
        :attr:`split`, of its own range)."""
        return self._holds[sender]

    def all_at_hand(self, hand: Sequence[object]) -> bool:
        """Whether a source's :meth:`~weightbus.sources.ModuleSource.at_hand` list gives
        every sender what it sends with no gather: its own range of every tensor this plan
        splits, and every other tensor sent whole. The same on every sender rank (which
        tensors are split, or plain, is), so either every rank walks its stream, or none.
        Checked once per list."""
        if self._hand_checked is not None and self._hand_checked[0] is hand:
            return self._hand_checked[1]
        splits = self.manifest.splits or [None] * len(self.manifest)
        sent = set().union(*self._holds)
        ok = len(hand) == len(self.manifest) and all(
            i in self.split or (splits[i] is None and hand[i] is not None) for i in sent)
        self._hand_checked = (hand, ok)
        return ok

    def __iter__(self) -> Iterator[ShardBucket]:
        return iter(self.buckets)

    def __len__(self) -> int:
        return len(self.buckets)


def chunk_box(shape: Sequence[int], dim: int, rank: int, world: int) -> Box:
    """Rank ``rank``'s part of a tensor of ``shape`` split along ``dim`` into ``world``
    parts the way ``torch.chunk`` splits it (ceil-sized parts, the last one shorter; a
    rank past the end gets an empty part)."""
    n = int(shape[dim])
    step = -(-n // world)
    begin = min(n, rank * step)
    return Box.rows(shape, begin, min(n, begin + step), dim)


def tp_placements(params: Mapping[str, torch.Tensor], rank: int, world: int, *,
                  split: Mapping[str, tuple[int, Sequence[int]]]
                  ) -> dict[str, list[tuple[Box, torch.Tensor]]]:
    """Placements (``engine.set_shard_destinations``) of a tensor-parallel module's
    parameters, by the caller's shard spec: ``split[name] = (dim, full_shape)`` says the
    parameter ``name`` holds this rank's :func:`chunk_box` of the update tensor ``name``
    (of ``full_shape``) along ``dim``; every other parameter is replicated (kept whole).
    Fused parameters (several update tensors in one) list their pairs by hand."""
    out: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    for name, p in params.items():
        if name in split:
            dim, full = split[name]
            box = chunk_box(full, dim, rank, world)
            if tuple(p.shape) != box.size:
                raise PlanError(f"parameter {name!r} has shape {tuple(p.shape)}, but rank {rank} of {world} "
                                f"keeps {box} of {tuple(full)} along dim {dim}")
            out[name] = [(box, p)]
        else:
            out[name] = [(Box.whole(p.shape), p)]
    return out


def dtensor_placements(named: Mapping[str, torch.Tensor]) -> dict[str, list[tuple[Box, torch.Tensor]]]:
    """Placements of a model whose parameters are DTensors (torch's own tensor parallelism,
    ``parallelize_module``; FSDP2 shards too) or plain tensors: a DTensor keeps the region
    of the update tensor its local shard holds (``Shard`` along any dimension of any mesh,
    uneven shards as DTensor makes them, ``Replicate``), written straight into its local
    tensor; a plain tensor is kept whole. ``Partial`` placements hold no region: refused."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    out: dict[str, list[tuple[Box, torch.Tensor]]] = {}
    for name, t in named.items():
        if not isinstance(t, DTensor):
            out[name] = [(Box.whole(t.shape), t)]
            continue
        start, size = [0] * t.dim(), list(t.shape)
        coords = t.device_mesh.get_coordinate()
        if coords is None:  # this rank is not in the tensor's mesh: it keeps nothing of it
            out[name] = []
            continue
        for mesh_dim, p in enumerate(t.placements):  # (DTensor shards in mesh-dimension order)
            if isinstance(p, Shard) and type(p) is Shard:
                part = chunk_box(size, p.dim, coords[mesh_dim], t.device_mesh.size(mesh_dim))
                start[p.dim] += part.start[p.dim]
                size[p.dim] = part.size[p.dim]
            elif not isinstance(p, Replicate):
                raise PlanError(f"parameter {name!r}: placement {p} holds no region of the tensor "
                                f"(only Shard and Replicate can receive)")
        with torch.no_grad():
            local = t.to_local()  # (the DTensor's own storage: written in place)
        box = Box(tuple(start), tuple(size))
        if tuple(local.shape) != box.size:
            raise PlanError(f"parameter {name!r}: its local shard has shape {tuple(local.shape)}, "
                            f"its placements say {box}")
        out[name] = [(box, local)]
    return out
