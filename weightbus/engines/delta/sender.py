"""Delta mode, trainer side: diff each rank's own pieces against its snapshots, encode
the records, pack them into buckets round by round (see the package's docstring)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from weightbus import config
from weightbus.engines.delta import cpu as kernels
from weightbus.engines.delta import gpu
from weightbus.engines.delta.encoding import (
    _GROUP,
    _HEADER,
    BITMAP,
    DENSE,
    FULL,
    SPARSE,
    _bits,
    _changed,
    _pack_bits,
    _pad,
    _padded,
    _weighted,
    body_sizes,
)
from weightbus.engines.delta.protocol import Engine, _agree, _plan, _PlanView
from weightbus.packing import buffers, native
from weightbus.plan import TRAILER_BYTES, Bucket, Manifest, share_of

#: yielded by ``_records(..., marks=True)`` once a round's first GPU diff is launched and
#: nothing of the round waited for: the sender agrees on and sends the last round meanwhile
LAUNCHED = object()


class Snapshots:
    """What a trainer rank sent last, per piece, in the wire dtype, on the piece's device."""

    def __init__(self) -> None:
        self.version: int | None = None  # the version the snapshots hold (None: none whole)
        self.fingerprint: int | None = None
        self.pieces: dict[tuple[int, int], torch.Tensor] = {}
        #: counts the changes to ``pieces`` (a snapshot made or replaced): a :class:`DiffTable`
        #: holds the snapshots' addresses, and is replayed only while this is what it saw
        self.generation = 0
        self.tables: dict[Any, DiffTable] = {}  # the callers' tables, by what their pieces are
        self.arenas = kernels.Arenas()  # where the CPU kernels encode, kept across updates
        self.device_arenas: dict[torch.device, kernels.Arena] = {}  # where the GPU kernels do
        self.layouts = gpu.Layouts()  # the GPU kernels' block tables, per group of piece sizes

    def keep(self, key: tuple[int, int], snap: torch.Tensor) -> torch.Tensor:
        """``snap`` as the snapshot of piece ``key`` (a new one, or one of another size)."""
        self.pieces[key] = snap
        self.generation += 1
        return snap

    def clear(self) -> None:
        """Another plan's pieces: none kept, nor the tables of their kernel calls."""
        self.pieces.clear()
        self.tables.clear()
        self.generation += 1

    def reset(self, host: bool = True) -> None:
        """A new update (or, ``host=False``, round): the last one's records are sent, their
        arenas free again. A round leaves the host's arenas alone: the sender starts the next
        round before it packs the last one's records (a GPU's next writes queue behind that
        packing; a host's kernels would write at once), so they hold an update's records."""
        if host:
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

    __slots__ = ("index", "start", "n", "e", "parts", "snaps", "elements", "nbytes", "staged", "_columns",
                 "_at")

    def __init__(self) -> None:
        self.index: list[int] = []
        self.start: list[int] = []
        self.n: list[int] = []
        self.e: list[int] = []
        self.parts: list[torch.Tensor] = []
        self.snaps: list[torch.Tensor] = []
        self.elements = 0
        self.nbytes = 0
        #: parts that are copies of their piece (a cast, a strided piece made contiguous), to
        #: make again where a :class:`DiffTable` replays the batch: (position, piece, dtype, first)
        self.staged: list[tuple[int, torch.Tensor, torch.dtype, int]] = []
        self._columns: torch.Tensor | None = None
        self._at: torch.Tensor | None = None

    def add(self, index: int, start: int, part: torch.Tensor, snap: torch.Tensor, n: int, e: int,
            copied_from: tuple[torch.Tensor, torch.dtype, int] | None = None) -> None:
        if copied_from is not None:
            self.staged.append((len(self.n), *copied_from))
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
        """int64 ``[5, pieces]``: new values' and snapshots' addresses, n, e, start (made
        once: a batch replayed by a :class:`DiffTable` holds the same pieces and snapshots)."""
        if self._columns is None:
            self._columns = torch.from_numpy(np.stack([
                native.data_ptrs(self.parts), native.data_ptrs(self.snaps),
                *(np.array(c, np.int64) for c in (self.n, self.e, self.start))]))
        return self._columns

    def at(self) -> torch.Tensor:
        """int64 ``[3, pieces]``: tensor, start, n (made once)."""
        if self._at is None:
            self._at = torch.tensor([self.index, self.start, self.n], dtype=torch.int64)
        return self._at

    def restage(self) -> None:
        """A replay: the parts that are copies made again from their pieces (one copy per
        piece, whatever its parts), their addresses put in the columns."""
        if not self.staged:
            return
        cols, made = self.columns(), {}
        for pos, piece, dtype, lo in self.staged:
            cur = made.get(id(piece))
            if cur is None:
                cur = made[id(piece)] = _flat(piece, dtype)
            part = self.parts[pos] = cur[lo:lo + self.n[pos]]
            cols[0, pos] = part.data_ptr()

    def release(self) -> None:
        """The copies let go once diffed (a record sent dense holds its own reference)."""
        for pos, *_ in self.staged:
            self.parts[pos] = _NONE


_NONE = torch.empty(0)


def _flat(piece: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A piece flat, contiguous, in the wire dtype (itself where it is all that already)."""
    cur = piece if piece.dim() == 1 else piece.reshape(-1)
    if cur.dtype != dtype:
        cur = cur.to(dtype)
    return cur if cur.is_contiguous() else cur.contiguous()


class DiffTable:
    """One call's worth of ``_records``' work on a fixed list of pieces, kept: its host
    batches and device groups, in order, with their columns (addresses, sizes). The loop
    over pieces (~4 us a piece in Python: 20,000 small tensors took 80 ms of host work for
    a 3 ms diff) runs once; while the caller sees the very same pieces (the same views of
    sources that did not move) and the snapshots are those it saw, an update replays the
    kernel calls alone, its rounds where they were (a piece that is cast or strided copied
    again first, as the loop would). Made only where every piece went to the kernels (no
    snapshot made, no torch path, not a full update)."""

    __slots__ = ("key", "ptrs", "steps", "generation", "identity")

    def __init__(self, key: list[Any], ptrs: np.ndarray | None = None, identity: bool = True) -> None:
        self.key, self.ptrs, self.identity = key, ptrs, identity
        #: (on a host, the batch) or (on a device, the group), in order; None where a round ends
        self.steps: list[tuple[bool, _Batch] | None] = []
        self.generation = -1

    def usable(self, key: list[Any], snaps: Snapshots, ptrs: np.ndarray | None = None) -> bool:
        """Whether a replay would diff the same pieces into the same snapshots."""
        return bool(self.steps) and self.generation == snaps.generation \
            and (not self.identity or native.same_items(key, self.key)) \
            and (ptrs is None or (self.ptrs is not None and np.array_equal(ptrs, self.ptrs)))


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
    dense = [Record([batch.index[i], DENSE, batch.start[i], batch.n[i], int(k[i])], int(digest[i]),
                    [_padded(batch.parts[i].view(torch.uint8))])
             for i in (kind == DENSE).nonzero().squeeze(1).tolist()]
    batch.release()
    if bool(kept.any()):
        at = batch.at()
        heads = torch.stack([at[0], kind, at[1], at[2], k, digest], 1)[kept]  # as Record.head
        sizes = nbytes[kept].tolist()
        yield Block(heads.contiguous(), sizes, out[:sum(sizes)])
    yield from dense








def part_elements(e: int, capacity: int, host: bool) -> int:
    """Elements of a piece diffed (and snapshotted) as one part: a dense record of them fits
    a bucket of ``capacity`` bytes and, on a host, a kernel call's room for the worst case
    (every element changed) stays small."""
    most = max(1, (capacity - 2 * _HEADER) // e)
    return min(most, max(1, _BATCH // e)) if host else most


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


def table_for(snaps: Snapshots, where: Any, key: list[Any], ptrs: np.ndarray | None = None,
              fits: Callable[[], bool] | None = None, identity: bool = True) -> DiffTable | None:
    """The :class:`DiffTable` of the pieces ``where`` names, to replay where its pieces are
    ``key`` (a list of objects, compared by identity; with ``ptrs``, their addresses too:
    tensors that keep their object when given new memory; ``identity`` False: by ``ptrs``
    alone, which then say each tensor's address and layout, ``key`` held only) and the
    snapshots the ones it saw; else a new one, made by the next ``_records`` over them, or
    None (and none kept) where ``fits`` says the pieces cannot be tabled."""
    table = snaps.tables.pop(where, None)
    if table is None or not table.usable(key, snaps, ptrs):
        if fits is not None and not fits():
            return None
        table = DiffTable(list(key), ptrs, identity)
    snaps.tables[where] = table
    return table


def _records(pieces: Iterator[tuple[int, int, torch.Tensor]], manifest: Manifest, snaps: Snapshots,
             full: bool, capacity: int, budget: list[int] | None = None, table: DiffTable | None = None,
             marks: bool = False) -> Iterator[Record | Block | object | None]:
    """The records of every piece, in order. With ``budget``, in rounds: round k ends at the
    first piece past ``budget[k]`` bytes of pieces in all (past the list, the rounds go on
    in steps of its last one); every record of a round is made, then None is yielded; the
    caller sends the round's records before it asks for more (their arenas are reused). With a ``table``
    (:func:`table_for`): replayed where it holds the calls already (``pieces`` is not
    read), else made while the pieces are diffed. ``marks``: :data:`LAUNCHED` yielded too."""
    snaps.reset()
    host = kernels.usable(torch.empty(0)) if not full else None  # the C kernels, for host pieces
    jobs = kernels.Jobs()  # their calls, on their threads
    batch = _Batch()  # host pieces for one call
    sent: deque[_Batch] = deque()  # batches in the kernels
    groups: dict[tuple[torch.device, int], _Batch] = {}  # device pieces diffed together, by element size
    in_flight: deque[tuple[_Batch, gpu.Diff]] = deque()  # groups whose GPU diff runs
    if table is not None and table.steps and not full:  # (the calls of the same pieces, made before)
        yield from _replay(table, host, jobs, snaps, marks)
        return
    steps = table.steps if table is not None and not full else None
    tabled = steps is not None  # (until a piece takes a path a replay would not repeat)

    def drained() -> list[tuple[bool, _Batch]]:  # (what _drain sends: the batch, the groups not full)
        return [(True, batch)] * bool(len(batch)) + [(False, g) for g in groups.values() if len(g)]

    metas, pieces_held = manifest.metas, snaps.pieces
    parts: dict[tuple[int, bool], int] = {}  # (element size, host) -> elements of a part
    taken, k = 0, 0  # bytes of the pieces so far; the round
    for index, start, piece in pieces:
        if budget is not None and taken >= _round_end(budget, k):  # (and a piece follows)
            if steps is not None:
                steps += [*drained(), None]
            yield from _drain(host, jobs, batch, sent, groups, snaps, in_flight, marks)
            batch, k = _Batch(), k + 1
            yield None
            snaps.reset(host=False)
        meta = metas[index]
        cur = _flat(piece, meta.dtype)  # (every part below is flat)
        copied = piece.dtype != meta.dtype or not piece.is_contiguous()  # (cur: a copy, made per update)
        n, e = cur.numel(), meta.itemsize
        taken += n * e
        where = (e, cur.is_cpu)
        most = parts.get(where)
        if most is None:  # (once per element size and side: a call per piece shows at 20k pieces)
            most = parts[where] = part_elements(e, capacity, cur.is_cpu)
        for lo in range(0, n, most):
            part, m = (cur, n) if n <= most else (cur[lo:lo + most], min(most, n - lo))
            key = (index, start + lo)
            snap = pieces_held.get(key)
            if snap is None or snap.numel() != m:
                snap = snaps.keep(key, torch.empty_like(part))
                got, tabled = encode(index, start + lo, part, snap, True), False
            elif full:
                got = encode(index, start + lo, part, snap, True)
            elif host is not None and part.is_cpu:
                batch.add(index, start + lo, part, snap, m, e, (piece, meta.dtype, lo) if copied else None)
                if batch.nbytes >= _BATCH:
                    sent.append(batch)
                    if steps is not None:
                        steps.append((True, batch))
                    for done in jobs.submit(_diff_batch, host, batch, snaps.arenas):
                        yield from _batch_records(sent.popleft(), done)
                    batch = _Batch()
                continue
            elif _grouped(part):
                where = (part.device, e)
                group = groups.get(where)
                if group is None:
                    group = groups[where] = _Batch()
                group.add(index, start + lo, part, snap, m, e, (piece, meta.dtype, lo) if copied else None)
                if group.elements >= _GROUP:
                    if steps is not None:
                        steps.append((False, group))
                    yield from _flush(group, snaps, in_flight, marks)
                    del groups[where]
                continue
            else:
                got, tabled = encode(index, start + lo, part, snap, False), False
            if got is not None:
                yield got
    if steps is not None:
        steps += drained()
        if tabled:
            table.generation = snaps.generation  # type: ignore[union-attr]
        else:
            steps.clear()
    yield from _drain(host, jobs, batch, sent, groups, snaps, in_flight, marks)


def _round_end(budget: list[int], k: int) -> int:
    """Bytes of pieces in all at which round ``k`` ends (see ``_records``)."""
    if k < len(budget):
        return budget[k]
    step = budget[-1] - (budget[-2] if len(budget) > 1 else 0)
    return budget[-1] + (k + 1 - len(budget)) * max(1, step)


def _replay(table: DiffTable, host: Any, jobs: kernels.Jobs, snaps: Snapshots, marks: bool = False
            ) -> Iterator[Record | Block | object | None]:
    """``_records`` from a table: its kernel calls again, in order, its rounds where they were
    (the parts that are copies made again first)."""
    sent: deque[_Batch] = deque()
    in_flight: deque[tuple[_Batch, gpu.Diff]] = deque()
    for step in table.steps:
        if step is None:  # (a round ends)
            yield from _drain(host, jobs, _Batch(), sent, {}, snaps, in_flight)
            yield None
            snaps.reset(host=False)
            continue
        on_host, batch = step
        batch.restage()
        if on_host:
            sent.append(batch)
            for done in jobs.submit(_diff_batch, host, batch, snaps.arenas):
                yield from _batch_records(sent.popleft(), done)
        else:
            yield from _flush(batch, snaps, in_flight, marks)
    yield from _drain(host, jobs, _Batch(), sent, {}, snaps, in_flight)


def _drain(host: Any, jobs: kernels.Jobs, batch: _Batch, sent: deque[_Batch],
           groups: dict[tuple[torch.device, int], _Batch], snaps: Snapshots,
           in_flight: deque[tuple[_Batch, gpu.Diff]], marks: bool = False
           ) -> Iterator[Record | Block | object]:
    """The records of every piece taken so far: the last host batch, the kernel calls in
    flight, the GPU groups (those not yet full, then those diffing)."""
    if len(batch):
        sent.append(batch)
        for done in jobs.submit(_diff_batch, host, batch, snaps.arenas):
            yield from _batch_records(sent.popleft(), done)
    for done in jobs.drain():
        yield from _batch_records(sent.popleft(), done)
    for group in groups.values():
        yield from _flush(group, snaps, in_flight, marks)
    groups.clear()
    while in_flight:
        group, diffing = in_flight.popleft()
        yield from _batch_records(group, diffing.finish())


def _grouped(t: torch.Tensor) -> bool:
    """Whether a piece is diffed with others of its device at once (a GPU's)."""
    return t.is_cuda


def _flush(group: _Batch, snaps: Snapshots, in_flight: deque[tuple[_Batch, gpu.Diff]], marks: bool = False
           ) -> Iterator[Record | Block | object]:
    """A group of device pieces, full: by the GPU kernels, its diff started and the one
    before it finished (the GPU diffs this group while the host lays that one out); else
    by torch ops (:func:`_encode_group`). ``marks``: :data:`LAUNCHED` after a launch
    with nothing else in flight (a round's first)."""
    if not len(group):
        return
    if gpu.usable(group.parts[0]) is None:  # (parts of a group: flat, of one device)
        yield from _encode_group(group)
        return
    device = group.parts[0].device
    in_flight.append((group, gpu.Diff(group.columns()[[0, 1, 2, 4]], group.e[0], device,
                                      snaps.device_arena(device), snaps.layouts)))
    if marks and len(in_flight) == 1:
        yield LAUNCHED
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
    group.release()


def send(engine: Engine, manifest: Manifest, stream: Any, version: int,
         error: str | None) -> tuple[str | None, int, int]:
    """The trainer side of one delta-mode update (after the header); returns (error, bytes
    moved, buckets), as ``BucketEngine._transfer``. Sent in rounds (:func:`_budget`): a
    round's buckets go out, then the next round is diffed while they move and are applied."""
    snaps: Snapshots = engine._snapshots  # type: ignore[attr-defined]
    held = snaps.version if snaps.fingerprint == manifest.fingerprint else None
    # (looked up before the agreement, which waits for the receivers: they leave the header later)
    table = None
    if error is None and stream is not None:
        try:
            table = _table(stream, snaps)
        except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
            error = f"{engine.where()}: looking at the source's tensors: {e}"
    full = engine.last_full = not _agree(engine, held, None)
    snaps.version = None  # until this update completes
    capacity = engine.bucket_size - TRAILER_BYTES - 8
    items: Iterator[Record | Block | None] | None = None
    if error is None and stream is not None:
        items = _records(pieces_of(stream, engine.trainer_rank, engine.n_senders), manifest, snaps, full,
                         capacity - 8, _budget(engine, manifest), table, marks=True)
    every: list[Bucket] = []  # every round's buckets
    wire, go_on = 0, True
    rounds = _Rounds(items, capacity) if items is not None else None
    mine, more = [], False  # this rank's buckets of the round (its records in them), whether one follows
    if error is None and rounds is not None:
        mine, more, error = rounds.take(engine.where())
    while go_on:
        if more and error is None:  # (the next round's first diff runs while this one is agreed and sent)
            error = rounds.ahead(engine.where())  # type: ignore[union-attr]
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
        mine, more = [], False
        if go_on and error is None:
            mine, more, error = rounds.take(engine.where())  # type: ignore[union-attr]
    if items is not None:
        items.close()  # (after a failure: its kernel calls and arenas let go)
    engine._flush_send(_PlanView(every))
    engine._delta_pending = (version, manifest.fingerprint)  # type: ignore[attr-defined]
    return error, wire, len(every)


def _table(stream: Any, snaps: Snapshots) -> DiffTable | None:
    """The kernel calls of the last update, to replay where the source's pieces are views of
    the same memory, laid out the same (its ``piece_owners``: a ModuleSource's tensors, or
    the local shards of its FSDP2 DTensors; a new ModuleSource of the same module, or a new
    state dict of it, is the same memory): compared by each owner's address, sizes,
    strides, dtype and device, the owners of the table kept (so no other tensor can take
    their memory meanwhile). None where the source cannot say, or where a tensor is
    strided (its share is a copy made per update)."""
    owners = getattr(getattr(stream, "source", None), "piece_owners", None)
    held = owners() if owners is not None else None
    if held is None:
        return None
    return table_for(snaps, "pieces", held, native.layout_keys(held),
                     lambda: all(map(torch.Tensor.is_contiguous, held)), identity=False)


def _budget(engine: Engine, manifest: Manifest) -> list[int] | None:
    """Where each trainer rank's rounds end, in bytes of its pieces in all (None: one
    round; see ``_records``). Each round is at least a bucket of pieces; its records are
    all the arena holds, and the next round is diffed while it moves and is applied.
    ``WEIGHTBUS_DELTA_ROUNDS`` rounds, by default 4 where buckets are on a GPU (the
    trainer's GPU diffs while the receivers' GPUs apply) and 1 on hosts, where the diff and
    the apply share the cores (our 2-core box, 0.6b, 2 % changed: 1 round 0.31-0.36x of the
    dense update, 4 rounds 0.36-0.40x). The last round is a quarter of the others: what
    the receivers apply after the trainers' last diff is the update's tail (8b over
    NVLink, 4 equal rounds: 4.5-7 ms of 28-43)."""
    rounds = config.env_integer("WEIGHTBUS_DELTA_ROUNDS", minimum=1, maximum=1024)
    if rounds is None:
        rounds = 4 if engine.device.type == "cuda" else 1
    if rounds == 1:
        return None
    share = -(-manifest.nbytes // engine.n_senders)
    unit = max(engine.bucket_size, int(share / (rounds - 0.75)))
    return [unit * (k + 1) for k in range(rounds - 1)]


class _Rounds:
    """The sender's rounds of records, bucket by bucket (``_records`` made with marks)."""

    def __init__(self, items: Iterator[Record | Block | object | None], capacity: int) -> None:
        self.items, self.capacity = items, capacity
        self.early: list[Any] = []  # the next round's items, taken while it was started

    def ahead(self, where: str) -> str | None:
        """The next round started: its items taken until its first GPU diff is launched (or
        it makes anything: then it runs on before the sends; a host's rounds). Returns the
        error that stopped it, if any."""
        try:
            with torch.no_grad():
                it = next(self.items, LAUNCHED)  # (none left: nothing to start)
        except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
            return _failed(where, e)
        if it is not LAUNCHED:
            self.early.append(it)
        return None

    def take(self, where: str) -> tuple[list[list[Record | Block]], bool, str | None]:
        """The buckets of the next round's records, whether a round follows, and the error
        that stopped it (None: none)."""
        follows = False

        def upto() -> Iterator[Record | Block]:
            nonlocal follows
            early, self.early = self.early, []
            for it in itertools.chain(early, self.items):
                if it is LAUNCHED:
                    continue
                if it is None:
                    follows = True
                    return
                yield it  # type: ignore[misc]

        try:
            with torch.no_grad():
                return list(_buckets(upto(), self.capacity)), follows, None
        except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
            return [], False, _failed(where, e)


def _failed(where: str, e: Exception) -> str:
    return f"{where}: taking the delta of the weights: {e}"


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
