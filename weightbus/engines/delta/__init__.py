"""Delta updates for the bucket engines (``delta=True``; all but ``colocated``, whose
floor is a copy on the same device): every trainer rank sends what
changed in its *own* piece of every tensor since the version the receivers hold, so no
rank gathers unchanged bytes and no rank funnels the others' changes.

At RL learning rates most bf16 weights do not change between steps (an fp32 master moves
far less than a bf16 rounding step): 1-15 % of elements change per step, often ~1 %.

Per update, after the core's header:

1. **Agree.** Every rank says which version it holds (trainer ranks: the version of their
   snapshot; receivers: the version they hold whole, and a chain digest of every patch they
   applied since their last full update). Two small all-reductions: a delta goes only if
   every rank holds the same version and every receiver the same chain; otherwise the
   update is *full* (a late joiner, a receiver that missed or failed an update).
2. **Diff where the bytes are.** Trainer rank r takes its piece of every tensor: its own
   dim-0 shard of an FSDP2/DTensor parameter (no communication), or its 1/T of a tensor
   every rank holds whole. Cast to the wire dtype, it is compared bit for bit with the
   snapshot of what that rank sent last (kept on the tensor's device: the rank's share of
   one wire-dtype copy). Each piece becomes records of at most a bucket each, encoded as
   positions + values, bitmap + values, or dense values, whichever is smallest; a full
   update sends dense records.
3. **Move.** Records are packed whole into buckets; the ranks agree on every bucket's size
   (two more small max-reductions: the counts, then the sizes) and the engine's own
   transport moves them (bucket b from trainer b mod T, as every update), trailers checked
   on every receiver. An update goes in rounds (:func:`_budget`): each round's records are
   made, agreed on and sent, and the next round is diffed while they move and are applied;
   the records' arena holds one round.
4. **Apply, verify.** A receiver writes every record into its destination tensors in place
   (``set_destinations``; the manager's workers set them from their sink). Each delta
   record carries ``sum(w(pos) * (new - old))`` over its positions, ``old`` being the
   trainer's snapshot; the receiver computes the same with *its* old values before writing,
   so a corrupt patch, a misplaced one or a receiver whose copy drifted is an error naming
   the tensor and the range, never silent.
5. **Verify the whole destination.** A patch's digest covers only what it touched: a copy
   that changed elsewhere (a bit flip, an engine or a user writing a weight) would apply
   every patch cleanly. Each receiver therefore keeps a running digest of every destination
   tensor, ``sum(w(i) * x[i])`` over all its elements: computed from the tensor after a
   full update, moved by every applied record's digest (the digest is linear, so the
   patches' digests are exactly how far it moves), and checked against a fresh pass over
   the tensors every ``verify_every`` delta updates (one read of the destinations, by the
   same kernels). A mismatch names the tensors that drifted and fails the update, after
   which the receiver holds no version and the next update is sent whole: the resync.

On a host, step 2 and step 4 run as C kernels (:mod:`.cpu`: one pass over memory
each, on a few threads); on a GPU as Triton kernels (:mod:`.gpu`: many pieces per
launch); without a C compiler or Triton, as torch ops (the same records, bit for bit).

Why hand-written: no library of the field diffs sharded tensors and applies the patches
into an inference engine's own tensors (verl's ``delta_sharded`` gathers the changes to
trainer rank 0; vLLM's sparse path takes user-made patches one tensor at a time).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Protocol

import torch

from weightbus import config
from weightbus.engines.delta import cpu as kernels
from weightbus.engines.delta import gpu
from weightbus.packing import buffers
from weightbus.plan import TRAILER_BYTES, Bucket, Manifest, share_of


class Engine(Protocol):
    """What delta mode uses of its engine: a :class:`weightbus.engines.bucket.BucketEngine`
    (which imports this package, so it is described here rather than imported)."""

    role: str | None
    device: torch.device
    version: int | None
    bucket_size: int
    num_buffers: int
    verify_every: int
    n_senders: int
    trainer_rank: int
    last_full: bool | None
    _snapshots: Snapshots
    _chain: Chain
    _delta_pending: Any
    _dest: dict[str, torch.Tensor] | None
    _stamper: buffers.Stamper

    def where(self) -> str: ...
    def _acquire(self, b: Bucket) -> torch.Tensor: ...
    def _send(self, b: Bucket, slot: torch.Tensor) -> None: ...
    def _flush_send(self, plan: Any) -> None: ...
    def _post_recv(self, b: Bucket) -> None: ...
    def _wait_recv(self, b: Bucket) -> torch.Tensor: ...
    def _release(self, b: Bucket) -> None: ...
    def _flush_recv(self, plan: Any) -> None: ...
    def _reduce_max(self, t: torch.Tensor, phase: str) -> None: ...

FULL, SPARSE, BITMAP, DENSE = 0, 1, 2, 3  # record kinds (FULL: dense, in a full update)
DIGEST = 4  # a kernel row that reads a whole destination's digest (never on the wire)
_WORDS = 6  # record header: tensor, kind, start, n, k, digest
_HEADER = _WORDS * 8
_NEUTRAL = -(1 << 62)  # a rank with no say in a field of the agreement
_MASK = (1 << 62) - 1
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SLICE = 1 << 22  # elements per step of a weighted sum over a dense range (bounds temporaries)
_GROUP = 1 << 29  # elements diffed together on a GPU (at most 1 GB of bf16 casts held; the torch
# path's mask: 512 MB)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bit patterns as integers of its width (compared and summed exactly)."""
    return t.view(_INTS[t.element_size()])


def _weighted(pos: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """sum(w(pos) * delta) in wrapping int64, w(pos) = pos * 2654435761 + 1 (a multiply, not
    a modulo: cheap): w depends on the position, so a value written to the wrong place shows.
    A 0-d tensor on the data's device: read back once per update, not per record."""
    return ((pos * 2654435761 + 1) * delta).sum()


def _changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Positions where two integer views differ. Compared 8 bytes at a time first (a bf16
    tensor: 4 elements per compare), then element by element only inside the words that
    differ: at a few percent of changed elements, ~3x less work than comparing elements."""
    per = 8 // new.element_size()
    n = new.numel()
    m = n // per * per
    if per > 1 and m and new.device.type == "cpu":  # (a GPU compares elements at full speed)
        try:
            wn, wo = new[:m].view(torch.int64), old[:m].view(torch.int64)
        except RuntimeError:  # not 8-byte aligned: element by element
            return (new != old).nonzero().squeeze(1)
        words = (wn != wo).nonzero().squeeze(1)
        # which lanes of a changed word differ (index_select: CPU fancy indexing is ~2x slower)
        x = torch.index_select(wn, 0, words) ^ torch.index_select(wo, 0, words)
        bits, shift = 8 * new.element_size(), per.bit_length() - 1
        lanes = torch.stack([((x >> (bits * j)) & ((1 << bits) - 1)) != 0 for j in range(per)], 1)
        hit = lanes.view(-1).nonzero().squeeze(1)
        idx = (torch.index_select(words, 0, hit >> shift) << shift) | (hit & (per - 1))
        if m < n:
            idx = torch.cat([idx, m + (new[m:] != old[m:]).nonzero().squeeze(1)])
        return idx
    return (new != old).nonzero().squeeze(1)


def _weighted_range(start: int, delta: torch.Tensor) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.int64, device=delta.device)
    for lo in range(0, delta.numel(), _SLICE):
        part = delta[lo:lo + _SLICE]
        pos = torch.arange(start + lo, start + lo + part.numel(), dtype=torch.int64, device=part.device)
        total += _weighted(pos, part)
    return total


def _pad(n: int) -> int:
    return (n + 7) // 8 * 8


def body_sizes(n: int, k: int, e: int) -> tuple[int, int, int]:
    """Body bytes of a record of ``n`` elements of ``e`` bytes, ``k`` of them changed, in
    each encoding: (positions + values, bitmap + values, dense values); the smallest goes
    (``weightbus plan`` sizes delta updates by the same rule)."""
    return _pad(4 * k) + e * k, _pad((n + 7) // 8) + e * k, e * n


def record_bytes(n: int, k: int, e: int) -> int:
    """Bytes a record of ``k`` changes among ``n`` elements takes in a bucket (header
    included; none when nothing changed)."""
    return _HEADER + min(body_sizes(n, k, e)) if k else 0


# ------------------------------------------------------------------ trainer side


class Snapshots:
    """What a trainer rank sent last, per piece, in the wire dtype, on the piece's device."""

    def __init__(self) -> None:
        self.version: int | None = None  # the version the snapshots hold (None: none whole)
        self.fingerprint: int | None = None
        self.pieces: dict[tuple[int, int], torch.Tensor] = {}
        self.arenas = kernels.Arenas()  # where the CPU kernels encode, kept across updates
        self.device_arenas: dict[torch.device, kernels.Arena] = {}  # where the GPU kernels do
        self.layouts = gpu.Layouts()  # the GPU kernels' block tables, per group of piece sizes

    def reset(self) -> None:
        """A new update: the last one's records are sent, their arenas free again."""
        self.arenas.reset()
        for a in self.device_arenas.values():
            a.reset()

    def device_arena(self, device: torch.device) -> kernels.Arena:
        if device not in self.device_arenas:
            self.device_arenas[device] = kernels.Arena(device=device)
        return self.device_arenas[device]


class Record:
    """One record: its header words (the digest a 0-d tensor until the update reads them all
    back at once) and its body, as 8-byte-padded byte pieces."""

    __slots__ = ("head", "digest", "body", "size")

    def __init__(self, head: list[int], digest: Any, body: list[torch.Tensor]):
        self.head, self.digest, self.body = head, digest, body
        self.size = _HEADER + sum(p.numel() for p in body)  # (its header sits in the directory)


class Block:
    """Records of one C-kernel call, kept columnar (tens of thousands of small tensors make
    an object per record cost more than their diff): their header rows (int64 ``[m, 6]``,
    digests included), each one's body bytes, and their bodies, one span of the arena."""

    __slots__ = ("heads", "sizes", "body", "size")

    def __init__(self, heads: torch.Tensor, sizes: list[int], body: torch.Tensor):
        self.heads, self.sizes, self.body = heads, sizes, body
        self.size = _HEADER * len(sizes) + body.numel()

    def split(self, room: int) -> tuple[Block | None, Block]:
        """The first records that fit in ``room`` bytes (None: not one), and the rest."""
        used = taken = i = 0
        while i < len(self.sizes) and used + _HEADER + self.sizes[i] <= room:
            used += _HEADER + self.sizes[i]
            taken += self.sizes[i]
            i += 1
        if i == 0:
            return None, self
        return (Block(self.heads[:i], self.sizes[:i], self.body[:taken]),
                Block(self.heads[i:], self.sizes[i:], self.body[taken:]))

    def records(self) -> list[Record]:
        """The same records as objects (views of the body): to look at, not to send."""
        out, at = [], 0
        for (*head, digest), size in zip(self.heads.tolist(), self.sizes, strict=True):
            out.append(Record(head, digest, [self.body[at:at + size]]))
            at += size
        return out


def encode(index: int, start: int, cur: torch.Tensor, snap: torch.Tensor | None,
           full: bool, idx: torch.Tensor | None = None) -> Record | None:
    """One record for elements ``[start, start + n)`` of tensor ``index`` (``cur``: their
    new values, flat, wire dtype), or None where nothing changed. Updates ``snap`` to
    ``cur``. ``idx``: the changed positions, where the caller found them already (else this
    waits for the device once, to count them). The torch path: see ``_diff_batch`` for the
    C kernels' (the same record, made in one pass over memory)."""
    n, e = cur.numel(), cur.element_size()
    if full or snap is None:
        if snap is not None:
            snap.copy_(cur)
        return Record([index, FULL, start, n, n], 0, [_padded(cur.view(torch.uint8))])
    new, old = _bits(cur), _bits(snap)
    idx = _changed(new, old) if idx is None else idx
    k = idx.numel()
    if k == 0:
        return None
    vals = torch.index_select(cur, 0, idx)
    digest = _weighted(idx + start, _bits(vals).long() - torch.index_select(old, 0, idx).long())
    sparse, bitmap, dense = body_sizes(n, k, e)
    if dense <= min(sparse, bitmap):
        kind, body = DENSE, [_padded(cur.view(torch.uint8))]
    elif sparse <= bitmap:
        kind, body = SPARSE, [_padded(idx.to(torch.int32).view(torch.uint8))]
    else:
        mask = torch.zeros(n, dtype=torch.bool, device=cur.device)
        mask[idx] = True
        kind, body = BITMAP, [_padded(_pack_bits(mask))]
    if kind != DENSE:
        body.append(_padded(vals.view(torch.uint8)))
    snap.index_copy_(0, idx, vals)
    return Record([index, kind, start, n, k], digest, body)


# Bytes of pieces the C kernels diff per call at least: a call costs ~0.1 ms of Python
# around it (the 0.6b preset's diff, 2 threads: 2 MiB, 198 calls, 93 ms; 16 MiB, 65 ms). A
# piece is cut there too, so a call asks its arena for at most ~2x this (room for every
# element changed) and arena chunks stay of one size; a call's cast pieces are held until it
# is done, and 2 per thread are in flight.
_BATCH = 16 << 20


class _Batch:
    """Pieces diffed together (a C-kernel call on a host, a launch on a GPU), kept as
    columns: tens of thousands of small tensors make a tuple per piece, and a ``numel()``
    per use, cost more than their diff."""

    __slots__ = ("index", "start", "n", "e", "parts", "snaps", "elements", "nbytes")

    def __init__(self) -> None:
        self.index: list[int] = []
        self.start: list[int] = []
        self.n: list[int] = []
        self.e: list[int] = []
        self.parts: list[torch.Tensor] = []
        self.snaps: list[torch.Tensor] = []
        self.elements = 0
        self.nbytes = 0

    def add(self, index: int, start: int, part: torch.Tensor, snap: torch.Tensor, n: int, e: int) -> None:
        self.index.append(index)
        self.start.append(start)
        self.n.append(n)
        self.e.append(e)
        self.parts.append(part)
        self.snaps.append(snap)
        self.elements += n
        self.nbytes += n * e

    def __len__(self) -> int:
        return len(self.n)

    def columns(self) -> torch.Tensor:
        """int64 ``[5, pieces]``: new values' and snapshots' addresses, n, e, start."""
        return torch.tensor([[p.data_ptr() for p in self.parts], [s.data_ptr() for s in self.snaps],
                             self.n, self.e, self.start], dtype=torch.int64)


def _diff_batch(lib: Any, batch: _Batch, arenas: kernels.Arenas) -> tuple[torch.Tensor, torch.Tensor]:
    """The C kernels' diff of many host pieces, in one call, into an arena (on a kernel
    thread: all but the call itself stays on the caller's, which holds the GIL)."""
    cols = batch.columns()
    n, e = cols[2], cols[3]
    bitmap = _pad((n + 7) // 8)
    rows = torch.cat([cols, (bitmap // 4)[None]]).t().contiguous()  # cap: k <= cap iff _pad(4 k) <= bitmap
    with arenas.lend() as arena:
        return kernels.diff_many(lib, rows, int((bitmap + n * e).sum()), arena)


def _batch_records(batch: _Batch, done: tuple[torch.Tensor, torch.Tensor]) -> Iterator[Record | Block]:
    """The records of a diffed batch (the kernel chose each one's kind, as ``encode``
    does): positions or bitmaps as one :class:`Block`, the few dense ones as records."""
    results, out = done
    kind, k, digest, nbytes = results[:, 0], results[:, 1], results[:, 2], results[:, 4]
    kept = (kind == SPARSE) | (kind == BITMAP)  # (their bodies lie in out one after the other)
    if bool(kept.any()):
        at = torch.tensor([batch.index, batch.start, batch.n], dtype=torch.int64)
        heads = torch.stack([at[0], kind, at[1], at[2], k, digest], 1)[kept]  # as Record.head
        sizes = nbytes[kept].tolist()
        yield Block(heads.contiguous(), sizes, out[:sum(sizes)])
    for i in (kind == DENSE).nonzero().squeeze(1).tolist():
        yield Record([batch.index[i], DENSE, batch.start[i], batch.n[i], int(k[i])], int(digest[i]),
                     [_padded(batch.parts[i].view(torch.uint8))])


def _padded(b: torch.Tensor) -> torch.Tensor:
    extra = _pad(b.numel()) - b.numel()
    return torch.cat([b, b.new_zeros(extra)]) if extra else b


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    n = mask.numel()
    m = torch.nn.functional.pad(mask.to(torch.uint8), (0, (-n) % 8)).view(-1, 8)
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=mask.device)
    return (m * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=bits.device)
    return ((bits.unsqueeze(1) & weights) != 0).view(-1)[:n]


def records(pieces: Iterator[tuple[int, int, torch.Tensor]], manifest: Manifest, snaps: Snapshots,
            full: bool, capacity: int) -> list[Record]:
    """Every record of this rank's pieces, each at most ``capacity`` bytes with its header,
    their digests read back from the device at once (as objects, to look at: updates send
    the kernels' blocks as they are)."""
    made = _read_digests(list(_records(pieces, manifest, snaps, full, capacity)))
    return [r for it in made for r in (it.records() if isinstance(it, Block) else [it])]


def _read_digests(items: list[Any]) -> list[Any]:
    """The digests still on the device (torch path), read back with one wait."""
    pending = [r for r in items if isinstance(r, Record) and isinstance(r.digest, torch.Tensor)]
    if pending:
        for r, d in zip(pending, torch.stack([r.digest for r in pending]).tolist(), strict=True):
            r.digest = d
    return items


def _buckets(items: Iterator[Record | Block], capacity: int) -> Iterator[list[Record | Block]]:
    """Records packed whole, in the order made, into buckets of at most ``capacity`` bytes
    (with the record count), their digests read back; a block is split between buckets."""
    out: list[Record | Block] = []
    used = 8
    for it in items:
        while isinstance(it, Block) and used + it.size > capacity:
            head, it = it.split(capacity - used)
            if head is None and not out:
                raise RuntimeError(f"a delta record of {_HEADER + it.sizes[0]} bytes does not fit a "
                                   f"bucket of {capacity}")
            if head is not None:
                out.append(head)
            yield _read_digests(out)
            out, used = [], 8
        if out and used + it.size > capacity:
            yield _read_digests(out)
            out, used = [], 8
        out.append(it)
        used += it.size
    if out:
        yield _read_digests(out)


def _records(pieces: Iterator[tuple[int, int, torch.Tensor]], manifest: Manifest, snaps: Snapshots,
             full: bool, capacity: int, budget: int | None = None) -> Iterator[Record | Block | None]:
    """The records of every piece, in order. With ``budget``, in rounds of pieces of about
    that many bytes: every record of a round is made, then None is yielded; the caller
    sends the round's records before it asks for more (their arenas are reused)."""
    snaps.reset()
    host = kernels.usable(torch.empty(0)) if not full else None  # the C kernels, for host pieces
    jobs = kernels.Jobs()  # their calls, on their threads
    batch = _Batch()  # host pieces for one call
    sent: deque[_Batch] = deque()  # batches in the kernels
    groups: dict[tuple[torch.device, int], _Batch] = {}  # device pieces diffed together, by element size
    in_flight: deque[tuple[_Batch, gpu.Diff]] = deque()  # groups whose GPU diff runs
    metas, pieces_held = manifest.metas, snaps.pieces
    taken = 0  # bytes of this round's pieces
    for index, start, piece in pieces:
        if budget is not None and taken >= budget:  # (and a piece follows: a round ends)
            yield from _drain(host, jobs, batch, sent, groups, snaps, in_flight)
            batch, taken = _Batch(), 0
            yield None
            snaps.reset()
        meta = metas[index]
        cur = piece if piece.dim() == 1 else piece.reshape(-1)
        if cur.dtype != meta.dtype:
            cur = cur.to(meta.dtype)
        if not cur.is_contiguous():  # (a strided 1-d piece: every part below is flat)
            cur = cur.contiguous()
        n, e = cur.numel(), meta.itemsize
        taken += n * e
        most = max(1, (capacity - 2 * _HEADER) // e)  # a dense record fits a bucket
        if cur.is_cpu:  # and a host call's room for the worst case (all changed) stays small
            most = min(most, max(1, _BATCH // e))
        for lo in range(0, n, most):
            part, m = (cur, n) if n <= most else (cur[lo:lo + most], min(most, n - lo))
            key = (index, start + lo)
            snap = pieces_held.get(key)
            if snap is None or snap.numel() != m:
                snap = pieces_held[key] = torch.empty_like(part)
                got = encode(index, start + lo, part, snap, True)
            elif full:
                got = encode(index, start + lo, part, snap, True)
            elif host is not None and part.is_cpu:
                batch.add(index, start + lo, part, snap, m, e)
                if batch.nbytes >= _BATCH:
                    sent.append(batch)
                    for done in jobs.submit(_diff_batch, host, batch, snaps.arenas):
                        yield from _batch_records(sent.popleft(), done)
                    batch = _Batch()
                continue
            elif _grouped(part):
                where = (part.device, e)
                group = groups.get(where)
                if group is None:
                    group = groups[where] = _Batch()
                group.add(index, start + lo, part, snap, m, e)
                if group.elements >= _GROUP:
                    yield from _flush(group, snaps, in_flight)
                    del groups[where]
                continue
            else:
                got = encode(index, start + lo, part, snap, False)
            if got is not None:
                yield got
    yield from _drain(host, jobs, batch, sent, groups, snaps, in_flight)


def _drain(host: Any, jobs: kernels.Jobs, batch: _Batch, sent: deque[_Batch],
           groups: dict[tuple[torch.device, int], _Batch], snaps: Snapshots,
           in_flight: deque[tuple[_Batch, gpu.Diff]]) -> Iterator[Record | Block]:
    """The records of every piece taken so far: the last host batch, the kernel calls in
    flight, the GPU groups (those not yet full, then those diffing)."""
    if len(batch):
        sent.append(batch)
        for done in jobs.submit(_diff_batch, host, batch, snaps.arenas):
            yield from _batch_records(sent.popleft(), done)
    for done in jobs.drain():
        yield from _batch_records(sent.popleft(), done)
    for group in groups.values():
        yield from _flush(group, snaps, in_flight)
    groups.clear()
    while in_flight:
        group, diffing = in_flight.popleft()
        yield from _batch_records(group, diffing.finish())


def _grouped(t: torch.Tensor) -> bool:
    """Whether a piece is diffed with others of its device at once (a GPU's)."""
    return t.is_cuda


def _flush(group: _Batch, snaps: Snapshots, in_flight: deque[tuple[_Batch, gpu.Diff]]
           ) -> Iterator[Record | Block]:
    """A group of device pieces, full: by the GPU kernels, its diff started and the one
    before it finished (the GPU diffs this group while the host lays that one out); else
    by torch ops (:func:`_encode_group`)."""
    if not len(group):
        return
    if gpu.usable(group.parts[0]) is None:  # (parts of a group: flat, of one device)
        yield from _encode_group(group)
        return
    device = group.parts[0].device
    in_flight.append((group, gpu.Diff(group.columns()[[0, 1, 2, 4]], group.e[0], device,
                                      snaps.device_arena(device), snaps.layouts)))
    while len(in_flight) > 1:
        done, diffing = in_flight.popleft()
        yield from _batch_records(done, diffing.finish())


def _encode_group(group: _Batch) -> Iterator[Record]:
    """Diff many device pieces by torch ops with two waits for the device in all (a wait per
    piece costs more than its compare on a GPU): their masks side by side, one
    ``nonzero``, one count per piece."""
    if not len(group):
        return
    total = group.elements
    mask = torch.empty(total, dtype=torch.bool, device=group.parts[0].device)
    starts, off = [], 0
    for part, snap, n in zip(group.parts, group.snaps, group.n, strict=True):
        torch.ne(_bits(part), _bits(snap), out=mask[off:off + n])
        starts.append(off)
        off += n
    pos = mask.nonzero().squeeze(1)
    del mask
    bounds = torch.tensor(starts[1:], dtype=torch.int64, device=pos.device)
    counts = torch.bincount(torch.bucketize(pos, bounds, right=True), minlength=len(group)).tolist()
    at = 0
    for i, (first, k) in enumerate(zip(starts, counts, strict=True)):
        if k:
            got = encode(group.index[i], group.start[i], group.parts[i], group.snaps[i], False,
                         idx=pos[at:at + k] - first)
            if got is not None:
                yield got
        at += k


def send(engine: Engine, manifest: Manifest, stream: Any, version: int,
         error: str | None) -> tuple[str | None, int, int]:
    """The trainer side of one delta-mode update (after the header); returns (error, bytes
    moved, buckets), as ``BucketEngine._transfer``. Sent in rounds (:func:`_budget`): a
    round's buckets go out, then the next round is diffed while they move and are applied."""
    snaps: Snapshots = engine._snapshots  # type: ignore[attr-defined]
    held = snaps.version if snaps.fingerprint == manifest.fingerprint else None
    full = engine.last_full = not _agree(engine, held, None)
    snaps.version = None  # until this update completes
    capacity = engine.bucket_size - TRAILER_BYTES - 8
    items: Iterator[Record | Block | None] | None = None
    if error is None and stream is not None:
        items = _records(pieces_of(stream, engine.trainer_rank, engine.n_senders), manifest, snaps, full,
                         capacity - 8, _budget(engine, manifest))
    every: list[Bucket] = []  # every round's buckets
    wire, go_on = 0, True
    while go_on:
        mine: list[list[Record | Block]] = []  # this rank's buckets of this round
        more = False
        if error is None and items is not None:
            try:
                with torch.no_grad():
                    mine, more = _round(items, capacity)
            except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                error = f"{engine.where()}: taking the delta of the weights: {e}"
                mine, more = [], False
        sizes = [8 + sum(r.size for r in b) for b in mine]
        plan, go_on = _plan(engine, sizes, every, more, error is not None)
        for b in plan:
            if b.owner != engine.trainer_rank:
                continue
            slot = engine._acquire(b)
            k = b.turn - plan[0].turn
            if error is None and k < len(mine):
                _fill(slot, mine[k])
            engine._stamper.stamp(slot, b, version, buffers.STATUS_ABORT if error else buffers.STATUS_OK,
                                  error or "")
            engine._send(b, slot)
            wire += b.wire_bytes
        every += plan
    if items is not None:
        items.close()  # (after a failure: its kernel calls and arenas let go)
    engine._flush_send(_PlanView(every))
    engine._delta_pending = (version, manifest.fingerprint)  # type: ignore[attr-defined]
    return error, wire, len(every)


def _budget(engine: Engine, manifest: Manifest) -> int | None:
    """Bytes of pieces per round on each trainer rank (None: one round). Each round is at
    least a bucket of pieces; its records are all the arena holds, and the next round is
    diffed while it moves and is applied. ``WEIGHTBUS_DELTA_ROUNDS`` rounds, by default 4
    where buckets are on a GPU (the trainer's GPU diffs while the receivers' GPUs apply)
    and 1 on hosts, where the diff and the apply share the cores (our 2-core box, 0.6b, 2 %
    changed: 1 round 0.31-0.36x of the dense update, 4 rounds 0.36-0.40x)."""
    rounds = config.env_integer("WEIGHTBUS_DELTA_ROUNDS", minimum=1, maximum=1024)
    if rounds is None:
        rounds = 4 if engine.device.type == "cuda" else 1
    if rounds == 1:
        return None
    return max(engine.bucket_size, -(-manifest.nbytes // (engine.n_senders * rounds)))


def _round(items: Iterator[Record | Block | None], capacity: int) -> tuple[list[list[Record | Block]], bool]:
    """The buckets of the next round's records, and whether a round follows."""
    follows = False

    def upto() -> Iterator[Record | Block]:
        nonlocal follows
        for it in items:
            if it is None:
                follows = True
                return
            yield it

    return list(_buckets(upto(), capacity)), follows


def _fill(slot: torch.Tensor, items: list[Record | Block]) -> None:
    """A bucket: the record count and every header first (one read on the receiver), then
    the bodies in the same order."""
    heads: list[torch.Tensor] = []
    rows: list[list[int]] = []  # records' header rows, until the next block
    for it in items:
        if isinstance(it, Block):
            if rows:
                heads.append(torch.tensor(rows, dtype=torch.int64))
                rows = []
            heads.append(it.heads)
        else:
            rows.append([*it.head, it.digest])
    if rows:
        heads.append(torch.tensor(rows, dtype=torch.int64))
    count = sum(len(h) for h in heads)
    raw = torch.cat([torch.tensor([count], dtype=torch.int64), *(h.reshape(-1) for h in heads)])
    raw = raw.view(torch.uint8)
    slot[:raw.numel()].copy_(raw)
    offset = raw.numel()
    for it in items:
        for p in ([it.body] if isinstance(it, Block) else it.body):
            slot[offset:offset + p.numel()].copy_(p, non_blocking=True)
            offset += p.numel()


def pieces_of(stream: Any, rank: int, world: int) -> Iterator[tuple[int, int, torch.Tensor]]:
    """(tensor index, first element, flat piece) of every tensor this trainer rank sends."""
    source = getattr(stream, "source", None)
    if source is not None and hasattr(source, "local_pieces"):
        yield from source.local_pieces(rank, world)
        return
    everyone = frozenset(range(world))
    for index, (_, t) in enumerate(stream.open(None, lambda i: everyone, rank)):
        yield index, *share_of(t, rank, world)


# ------------------------------------------------------------------ receiver side


class Chain:
    """A receiver's record of what it holds: the version, a digest of every patch applied
    since its last full update (equal on receivers that applied the same ones), and the
    running digest each destination tensor should have (see the module's step 5)."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.digest = 0
        self.sums: torch.Tensor | None = None  # int64 per tensor, on the host (None: not known)
        self.unchecked = 0  # delta updates applied since the destinations were last checked


def receive(engine: Engine, version: int, manifest: Manifest,
            error: str | None) -> tuple[str | None, int, int]:
    """The receiver side of one delta-mode update (after the header): applies every record
    into the destinations. Returns (error, bytes, buckets)."""
    chain: Chain = engine._chain  # type: ignore[attr-defined]
    dest = engine._dest
    held = chain.version if dest is not None and engine.version == chain.version else None
    full = engine.last_full = not _agree(engine, held, chain.digest)
    targets: list[torch.Tensor | None] = []
    if error is None:
        if dest is None:
            error = (f"{engine.where()}: delta mode writes in place: call set_destinations() (the "
                     f"manager's workers do it from their sink) before receiving")
        else:
            targets, error = _targets(engine, manifest, dest)
    chain.version, applied = None, 0
    verify = engine.verify_every > 0
    moved = torch.zeros(len(manifest.metas), dtype=torch.int64) if verify and not full else None
    every: list[Bucket] = []  # every round's buckets
    go_on = True
    while go_on:
        plan, go_on = _plan(engine, [], every)
        for b in plan[: engine.num_buffers]:
            engine._post_recv(b)
        for i, b in enumerate(plan):
            slot = engine._wait_recv(b)
            status, msg = buffers.check_trailer(slot, b, version, engine.where())
            if status != buffers.STATUS_OK and error is None:
                error = msg or f"{engine.where()}: bucket {b.index} arrived with status {status}"
            if error is None:
                engine.version = None  # from the first byte written on, the old version is gone
                try:
                    with torch.no_grad():  # destinations may be parameters
                        applied += _apply(slot, b.used, targets, manifest, full, moved)
                except _Drift as e:
                    error = f"{engine.where()}: {e}"
                except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                    error = f"{engine.where()}: applying bucket {b.index}: {e}"
            engine._release(b)
            if i + engine.num_buffers < len(plan):
                engine._post_recv(plan[i + engine.num_buffers])
        every += plan
    engine._flush_recv(_PlanView(every))
    if error is None and verify:
        error = _verify(engine, chain, targets, manifest, version, moved)
    if error is not None or not verify:
        chain.sums = None
    if error is None:
        chain.digest = ((version * 7919 + 1) if full else
                        (chain.digest * 1000003 + applied + version)) & _MASK
        engine._delta_pending = (version, full)  # type: ignore[attr-defined]
    return error, sum(b.wire_bytes for b in every), len(every)


class _Drift(Exception):
    pass


def _verify(engine: Engine, chain: Chain, targets: Any, manifest: Manifest, version: int,
            moved: torch.Tensor | None) -> str | None:
    """Step 5: move every destination's running digest by what this update applied
    (``moved``, None: a full update, which sets them from the tensors), and, when a check is
    due, compare them with a fresh pass over the destinations. Returns the error, or None."""
    if moved is None or chain.sums is None:  # (a full update; or a joiner's first delta: from here)
        chain.sums, chain.unchecked = digests(targets), 0
        return None
    chain.sums += moved
    chain.unchecked += 1
    if chain.unchecked < engine.verify_every:
        return None
    chain.unchecked = 0
    bad = (digests(targets) != chain.sums).nonzero().squeeze(1).tolist()
    if not bad:
        return None
    names = ", ".join(repr(manifest.metas[i].name) for i in bad[:3]) + (f" and {len(bad) - 3} more"
                                                                       if len(bad) > 3 else "")
    return (f"{engine.where()}: delta mode: this rank's copy of {names} no longer holds what the "
            f"trainer sent: it changed at elements no patch touched since it was last checked (a bit "
            f"flip, or something other than weightbus wrote it). Version {version} is not held; the "
            f"next update is sent whole (a dense resync)")


def digests(targets: list[torch.Tensor]) -> torch.Tensor:
    """Every flat tensor's whole digest, ``sum(w(i) * x[i])`` over its elements' bit
    patterns (int64 on the host): one read of each, by the kernels of their device (a
    row per tensor, in one call) or, without them, by torch ops."""
    if not isinstance(targets, _Targets):
        targets = _Targets(targets)
    if not len(targets):
        return torch.zeros(0, dtype=torch.int64)
    size = targets.size
    if targets.device is not None:
        if (lib := kernels.usable(targets[0])) is not None:  # (a row each, written nowhere)
            zero = torch.zeros_like(size)
            rows = torch.stack([torch.full_like(size, DIGEST), targets.addr, size, targets.esize, zero, zero,
                                zero, size], 1)
            return kernels.apply_many(lib, rows)[:, 0].clone()
        if gpu.usable(targets[0]) is not None:
            return gpu.digests(targets.addr, size, targets.esize, targets.device)
    return torch.stack([_weighted_range(0, _bits(t).long()).cpu() for t in targets])


def _apply_torch(kind: int, raw: torch.Tensor, vals: torch.Tensor, sub: torch.Tensor, n: int, k: int,
                 start: int, name: str, r: int, bounds: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
    """A SPARSE or BITMAP record written by torch ops (a GPU, or no C kernels); returns our
    digest (a 0-d tensor, read back with the bucket's others)."""
    if kind == SPARSE:
        pos = raw.view(torch.int32).long()
        bounds.append((r, ((pos < 0) | (pos >= n)).any()))
        pos = pos.clamp(0, max(n - 1, 0))  # an out-of-range position fails the check, not here
    else:
        pos = _unpack_bits(raw, n).nonzero().squeeze(1)
        if pos.numel() != k:
            raise _Drift(f"tensor {name!r}: a patch of elements [{start}, {start + n}) says "
                         f"{k} changes but its bitmap has {pos.numel()}")
    old = torch.index_select(_bits(sub), 0, pos)  # (index_select, index_copy_: ~2x fancy indexing)
    sub.index_copy_(0, pos, vals)
    return _weighted(pos + start, _bits(vals).long() - old.long())


class _Targets(list):  # type: ignore[type-arg]
    """The flat destination of every tensor and, read once per update (not per record),
    their addresses, sizes and element sizes as (host) tensors, and the device all are on
    (None: more than one; then a bucket is laid out by tensor ops and written by the
    kernels of that device)."""

    def __init__(self, flat: list[torch.Tensor]):
        super().__init__(flat)
        at = [(t.data_ptr(), t.numel(), t.element_size()) for t in flat]
        self.addr, self.size, self.esize = (torch.tensor([w[i] for w in at], dtype=torch.int64)
                                            for i in range(3))
        devices = {t.device for t in flat}
        self.device = devices.pop() if len(devices) == 1 else None


def _targets(engine: Engine, manifest: Manifest, dest: dict[str, torch.Tensor]
             ) -> tuple[list[torch.Tensor | None], str | None]:
    """Every tensor's destination, flat and checked; kept for the next update while the
    destinations are the same tensors at the same addresses (a check per tensor that costs
    a fraction of making them: models with many small tensors)."""
    held = getattr(engine, "_delta_targets", None)  # (dest, fingerprint, size, tensors, targets)
    fp = manifest.tensors_fingerprint
    if held is not None and held[0] is dest and held[1] == fp and held[2] == len(dest) \
            and [t.data_ptr() for t in held[3]] == held[4].addr.tolist():
        return held[4], None
    out: list[torch.Tensor | None] = []
    originals = []
    for m in manifest.metas:
        t = dest.get(m.name)
        if t is None or t.dtype != m.dtype or tuple(t.shape) != tuple(m.shape) or not t.is_contiguous():
            have = "none" if t is None else f"{t.dtype}{list(t.shape)}"
            return [], (f"{engine.where()}: delta mode writes every tensor in place, but the destination "
                        f"of {m.describe()} is {have} (a contiguous tensor of the wire dtype and shape "
                        f"is needed)")
        originals.append(t)
        out.append(t.view(-1))
    targets = _Targets(out)
    engine._delta_targets = (dest, fp, len(dest), originals, targets)  # type: ignore[attr-defined]
    return targets, None


def _apply(slot: torch.Tensor, used: int, targets: list[Any], manifest: Manifest, full: bool,
           moved: torch.Tensor | None = None) -> int:
    """Write every record of a bucket into its target; returns the sum of their digests,
    and adds each into its tensor's entry of ``moved`` (where given).
    Reads the directory once and checks every digest (and position) at once at the end:
    host tensors by the C kernels, a call per thread for the whole bucket; others by
    torch ops."""
    if used < 8:
        return 0
    count = int(slot[:8].view(torch.int64).item())
    if not 0 <= count <= (used - 8) // _HEADER:
        raise _Drift(f"a delta bucket is malformed (it says {count} records in {used} bytes)")
    if not isinstance(targets, _Targets):
        targets = _Targets(targets)
    if count and targets.device is not None and targets.device != slot.device:
        # (a host bucket for GPU tensors, as gloo moves: the records are few bytes, one copy
        # of them to the tensors' device, then its kernels)
        slot = slot[:used].to(targets.device)
    if count and targets.device == slot.device:
        if (lib := kernels.usable(slot)) is not None:
            return _apply_listed(lambda rows: kernels.apply_many(lib, rows), slot, used, count, targets,
                                 manifest, moved)
        if gpu.usable(slot) is not None:
            return _apply_listed(lambda rows: gpu.apply_many(rows, slot.device), slot, used, count, targets,
                                 manifest, moved)
    heads = slot[8:8 + count * _HEADER].view(torch.int64).view(count, _WORDS).tolist() if count else []
    offset, total = 8 + count * _HEADER, 0
    checks: list[tuple[int, Any, int]] = []  # (record, our digest, theirs)
    bounds: list[tuple[int, torch.Tensor]] = []  # (record, whether a position was out of range)
    for r, (index, kind, start, n, k, digest) in enumerate(heads):
        if not 0 <= index < len(targets) or kind not in (FULL, SPARSE, BITMAP, DENSE):
            raise _Drift(f"a delta record is malformed (tensor {index}, kind {kind})")
        dst = targets[index]
        size, e = dst.numel(), dst.element_size()
        if start < 0 or n < 0 or not 0 <= k <= n or start + n > size:
            raise _Drift(f"tensor {manifest.metas[index].name!r}: a record for elements [{start}, "
                         f"{start + n}) lies outside its {size}")
        where = offset  # positions or bitmap (none for dense values)
        if kind in (SPARSE, BITMAP):
            offset += _pad(4 * k) if kind == SPARSE else _pad((n + 7) // 8)
        values = offset
        offset += _pad((n if kind in (FULL, DENSE) else k) * e)
        if offset > used:
            raise _Drift(f"tensor {manifest.metas[index].name!r}: a delta record runs past its bucket")
        total += digest if kind != FULL else 0
        meta = manifest.metas[index]
        sub = dst[start:start + n]
        if kind == FULL:
            sub.copy_(slot[values:values + n * e].view(meta.dtype))
        elif kind == DENSE:
            vals = slot[values:values + n * e].view(meta.dtype).to(sub.device)  # (targets on many devices)
            checks.append((r, _weighted_range(start, _bits(vals).long() - _bits(sub).long()), digest))
            sub.copy_(vals)
        else:
            raw = slot[where:where + (4 * k if kind == SPARSE else (n + 7) // 8)].to(sub.device)
            vals = slot[values:values + k * e].view(meta.dtype).to(sub.device)
            checks.append((r, _apply_torch(kind, raw, vals, sub, n, k, start, meta.name, r, bounds), digest))
    bad = set()
    if bounds:
        flags = torch.stack([f for _, f in bounds]).tolist()
        bad |= {r for (r, _), f in zip(bounds, flags, strict=True) if f}
    if checks:
        ours = torch.stack([torch.as_tensor(d, dtype=torch.int64, device=slot.device) for _, d, _ in checks])
        theirs = torch.tensor([d for _, _, d in checks], dtype=torch.int64, device=slot.device)
        bad |= {checks[i][0] for i in (ours != theirs).nonzero().squeeze(1).tolist()}
    if bad:
        raise _mismatch(heads[min(bad)], manifest)
    if moved is not None and heads:
        at = torch.tensor(heads, dtype=torch.int64)
        patch = at[:, 1] != FULL
        moved.index_add_(0, at[patch, 0], at[patch, 5])
    return total


def _mismatch(head: list[int], manifest: Manifest) -> _Drift:
    index, _, start, n, _, digest = head
    return _Drift(f"tensor {manifest.metas[index].name!r}: elements [{start}, {start + n}) do not match "
                  f"the trainer's after the patch (its digest {digest:#x}): the patch, or this rank's "
                  f"copy of the previous version, is corrupt")


def _apply_listed(apply_rows: Any, slot: torch.Tensor, used: int, count: int, targets: _Targets,
                  manifest: Manifest, moved: torch.Tensor | None) -> int:
    """``_apply`` by the kernels (C on a host, Triton on a GPU): the directory read once,
    checked and laid out by tensor ops (no Python per record: models have tens of thousands
    of tensors), every record written by ``apply_rows`` (a row per record, see
    ``cpu.apply_many``), then every check at once."""
    heads = slot[8:8 + count * _HEADER].view(torch.int64).view(count, _WORDS).cpu()
    index, kind, start, n, k, digest = heads.unbind(1)

    def first(bad: torch.Tensor) -> list[int] | None:
        return heads[int(bad.nonzero()[0, 0])].tolist() if bool(bad.any()) else None

    if (h := first((index < 0) | (index >= len(targets)) | (kind < FULL) | (kind > DENSE))) is not None:
        raise _Drift(f"a delta record is malformed (tensor {h[0]}, kind {h[1]})")
    size, e = targets.size[index], targets.esize[index]
    # (each bound apart first: no sum of two huge numbers can wrap around)
    if (h := first((start < 0) | (n < 0) | (k < 0) | (k > n) | (start > size) | (n > size)
                   | (start + n > size))) is not None:
        raise _Drift(f"tensor {manifest.metas[h[0]].name!r}: a record for elements [{h[2]}, {h[2] + h[3]}) "
                     f"lies outside its {targets[h[0]].numel()}")
    sparse, bitmap = kind == SPARSE, kind == BITMAP
    where = torch.where(sparse, (4 * k + 7) // 8 * 8, torch.where(bitmap, ((n + 7) // 8 + 7) // 8 * 8, 0))
    values = (torch.where(sparse | bitmap, k, n) * e + 7) // 8 * 8
    end = torch.cumsum(where + values, 0) + (8 + count * _HEADER)
    if (h := first(end > used)) is not None:
        raise _Drift(f"tensor {manifest.metas[h[0]].name!r}: a delta record runs past its bucket")
    at = slot.data_ptr() + end - values - where  # each record's first byte
    rows = torch.stack([kind, targets.addr[index] + start * e, n, e, start, at, at + where, k], 1)
    ours, status = apply_rows(rows).unbind(1)
    miscounted = bitmap & (status != k)
    if (h := first(miscounted)) is not None:
        got = int(status[int(miscounted.nonzero()[0, 0])])
        raise _Drift(f"tensor {manifest.metas[h[0]].name!r}: a patch of elements [{h[2]}, {h[2] + h[3]}) "
                     f"says {h[4]} changes but its bitmap has {'bits past its end' if got < 0 else got}")
    if (h := first((sparse & (status >= 0)) | ((kind != FULL) & (ours != digest)))) is not None:
        raise _mismatch(h, manifest)
    patch = kind != FULL
    if moved is not None:
        moved.index_add_(0, index[patch], digest[patch])
    return sum(digest[patch].tolist())


# ------------------------------------------------------------------ both sides


def _agree(engine: Engine, held: int | None, chain: int | None) -> bool:
    """Whether every rank holds the same version (and every receiver the same chain): two
    max-reductions, of the values and of their negations."""
    v = -1 if held is None else held
    c = _NEUTRAL if chain is None else chain
    hi = torch.tensor([v, c], dtype=torch.int64)
    lo = torch.tensor([-v, _NEUTRAL if chain is None else -c], dtype=torch.int64)
    engine._reduce_max(hi, "delta: agreeing on the version held")
    engine._reduce_max(lo, "delta: agreeing on the version held")
    return hi[0].item() >= 1 and hi[0].item() == -lo[0].item() and hi[1].item() == -lo[1].item()


def _plan(engine: Engine, mine: list[int], before: list[Bucket], more: bool = False,
          failed: bool = False) -> tuple[list[Bucket], bool]:
    """The buckets of one round of a delta update (bucket b from trainer b mod T, as
    always; numbered on from ``before``, the rounds' so far), from each trainer rank's
    bucket sizes, and whether another round follows (a trainer rank has pieces left, and
    none failed): two max-reductions (the counts and flags, then the sizes)."""
    T = engine.n_senders
    rank = engine.trainer_rank if engine.role == "trainer" else -1
    head = torch.zeros(T + 2, dtype=torch.int64)
    if rank >= 0:
        head[rank], head[T], head[T + 1] = len(mine), int(more), int(failed)
    engine._reduce_max(head, "delta: agreeing on the buckets")
    most = max(1, int(head[:T].max().item()))
    sizes = torch.zeros(T, most, dtype=torch.int64)
    if rank >= 0 and mine:
        sizes[rank, :len(mine)] = torch.tensor(mine, dtype=torch.int64)
    engine._reduce_max(sizes.view(-1), "delta: agreeing on the buckets")
    first, turn = (before[-1].index + 1, before[-1].turn + 1) if before else (0, 0)
    plan = [Bucket(first + k * T + r, r, (), int(sizes[r, k].item()), turn + k)
            for k in range(most) for r in range(T)]
    return plan, bool(head[T].item()) and not head[T + 1].item()


class _PlanView:
    """What the transport's flush hooks read of a plan."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = tuple(buckets)

    def __len__(self) -> int:
        return len(self.buckets)


def settle(engine: Engine, ok: bool) -> None:
    """After the outcome is agreed: what this rank holds from now on."""
    pending = getattr(engine, "_delta_pending", None)
    engine._delta_pending = None  # type: ignore[attr-defined]
    if engine.role == "trainer":
        snaps: Snapshots = engine._snapshots  # type: ignore[attr-defined]
        if ok and pending is not None:
            snaps.version, snaps.fingerprint = pending
        else:
            snaps.version = None
    else:
        chain: Chain = engine._chain  # type: ignore[attr-defined]
        chain.version = pending[0] if ok and pending is not None else None

