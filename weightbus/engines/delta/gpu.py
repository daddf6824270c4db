"""Delta mode's GPU kernels (Triton): the trainer's diff and the receiver's apply over many
tensors per launch, where torch's ops cost a dozen launches and a wait per record (an 8b
model's update took 4.6x the dense one on 2xH200, a 30b MoE's 52x).

Every launch covers many pieces through tables of their addresses (multi-tensor, as fused
optimizers do): a program takes ``BLOCK`` elements of one piece. The trainer's diff is two
launches per group of pieces and one wait for the device (:class:`Diff`):

1. *diff*: each block reads the new values and the snapshot once (16 bytes at a time),
   keeps its changed elements' bits (a bitmap) and count, sums its share of the digest and
   writes the new values into the snapshot (whole blocks in one launch, the pieces' partial
   last blocks in a second: one body for both ran 1.3x slower); one wait, for every piece's
   count and digest, from which the host chooses each record's kind (positions, bitmap or
   dense values; the choice of :func:`delta.encode`) and lays the bodies out, one after the
   other, in an arena kept between updates;
2. *write*: each block of a positions or bitmap record takes its changes from its bits, a
   lane per 32-bit word, one set bit per word per step (work that follows the changes, not
   the elements), and writes the positions (at the block's prefix of the piece's count) or
   the bitmap bytes, and the values; nothing waits for it (the bucket's copy comes after it
   on the stream). The next group's pass one is launched before this group's layout, so the
   GPU works while the host lays out; a group's block tables are made once per set of piece
   sizes and kept (:class:`Layouts`), as the host's ops would otherwise cost more than the
   GPU's diff.

The receiver's apply is two launches per bucket (bitmap records count their set bits per
block first, so each block knows where its values start; a bitmap's values are then written
as pass two takes them, a word per lane) and one wait for the digests and statuses. The
records are the C kernels' and the torch path's, bit for bit (tests/test_delta.py checks
them under Triton's interpreter, and on a GPU where there is one). Without Triton, or with
``WEIGHTBUS_DELTA_KERNELS=0``, GPUs use the torch path.

Why hand-written: no library of the field diffs or patches many tensors in one launch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch

from weightbus import config

log = logging.getLogger(__name__)

BLOCK = 4096  # elements per program (a multiple of 32: a block's bits are whole 32-bit words)
WARPS = [8, 4]  # warps per program of the diff and the write (the fastest on an H100)
_FULL, _SPARSE, _BITMAP, _DENSE, _NONE = 0, 1, 2, 3, -1  # as delta.py's kinds
_lock = threading.Lock()
_kernels: Any = None
_tried = False


def _load() -> Any:
    from weightbus.engines.delta import gpu_triton  # (Triton imported on first use: slow to import)

    return gpu_triton


def kernels() -> Any:
    """The kernels, or None (no Triton, or ``WEIGHTBUS_DELTA_KERNELS=0``)."""
    global _kernels, _tried
    if _tried:
        return _kernels
    with _lock:
        if not _tried:
            if config.flag("WEIGHTBUS_DELTA_KERNELS", True):
                try:
                    _kernels = _load()
                except ImportError as e:
                    log.warning("weightbus: no Triton (%s): delta mode on a GPU uses the slower torch "
                                "path", e)
            _tried = True
    return _kernels


def usable(*tensors: torch.Tensor) -> Any:
    """The kernels, where every tensor is a contiguous CUDA tensor (else None)."""
    for t in tensors:
        if t.device.type != "cuda" or not t.is_contiguous():
            return None
    return kernels()


def _int(tl: Any, e: int) -> Any:
    """The integer type a bit pattern of ``e`` bytes is compared and summed as (unsigned
    for one byte, signed otherwise: as the torch path's views)."""
    return {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}[e]


class _WholeFirst:
    """The kernels' blocks of items (pieces, or records) of ``sizes`` elements (a host
    tensor): every item's whole blocks, item after item, then each item's partial last block
    (an item's blocks in the order of its elements, but not next to each other: its last
    block comes after all whole ones, so the diff's two launches each take a run of blocks).
    ``item`` and ``off`` (on ``device``) give each block's item and first element. Made on
    the host and copied once; the diff's are kept per group of piece sizes (see
    :class:`Layouts`): made anew, they cost the host more than the GPU's diff of the group."""

    def __init__(self, sizes: torch.Tensor, device: torch.device) -> None:
        per = sizes // BLOCK
        partial = (sizes % BLOCK) != 0
        self.whole = int(per.sum())
        tails = partial.nonzero().flatten()
        last = torch.full(sizes.shape, -1, dtype=torch.int64)
        last[tails] = self.whole + torch.arange(len(tails))
        first = torch.cumsum(per, 0) - per  # (each piece's whole blocks: [first, first + per))
        item = torch.repeat_interleave(torch.arange(len(sizes)), per, output_size=self.whole)
        item = torch.cat([item, tails])
        off = torch.cat([torch.arange(self.whole) - first[item[:self.whole]], per[tails]]) * BLOCK
        b = torch.arange(len(item))
        # for a block's changes before it in its piece: a whole block's, from its piece's
        # first; a partial one's, all the piece's whole blocks
        upto = torch.where(b < self.whole, b, (first + per)[item])
        host = torch.stack([item, off, upto, first[item]])
        ends = torch.stack([first, first + per, last.clamp(min=0), (last >= 0).long()])
        both = torch.cat([host.flatten(), ends.flatten()]).to(device, non_blocking=True)
        self.item, self.off, self._upto, self._lo = both[:host.numel()].view(4, -1)
        self._first, self._end, self._last, self._has_last = both[host.numel():].view(4, -1)
        self.nbytes = both.numel() * 8

    def per_piece(self, running: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Each piece's sums of the rows of ``x`` (int64, a column per block), from
        ``running``, their running sums."""
        if not x.shape[1]:
            return x.new_zeros(len(x), len(self._first))
        ex = torch.nn.functional.pad(running, (1, 0))  # (exclusive: ex[:, b] sums the blocks before b)
        return ex[:, self._end] - ex[:, self._first] + x[:, self._last] * self._has_last

    def before(self, running: torch.Tensor) -> torch.Tensor:
        """Each block's sum of the blocks before it in its piece (``running``: a running sum
        over blocks)."""
        ex = torch.nn.functional.pad(running, (1, 0))
        return ex[self._upto] - ex[self._lo]


class Layouts:
    """The block layouts of the groups a trainer rank diffs, kept between updates (its
    groups' piece sizes are the same every update): ~32 bytes per block of 4,096 elements,
    at most ``most`` bytes of them (past that they are dropped and made anew: a source whose
    groups change every update costs host time, never memory)."""

    def __init__(self, most: int = 512 << 20) -> None:
        self._held: dict[tuple[bytes, torch.device], _WholeFirst] = {}
        self._most = most
        self._lock = threading.Lock()
        self.nbytes = 0  # the device memory they hold

    def get(self, sizes: torch.Tensor, device: torch.device) -> _WholeFirst:
        key = (sizes.numpy().tobytes(), device)
        with self._lock:
            found = self._held.get(key)
        if found is None:
            found = _WholeFirst(sizes, device)
            with self._lock:
                if key in self._held:  # (made by another thread meanwhile)
                    return self._held[key]
                if self.nbytes + found.nbytes > self._most:
                    self._held.clear()
                    self.nbytes = 0
                self._held[key] = found
                self.nbytes += found.nbytes
        return found


def _pad(n: torch.Tensor) -> torch.Tensor:
    return (n + 7) // 8 * 8


def _on(device: torch.device) -> Any:
    """Launches on ``device`` (Triton launches on the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def diff_many(table: torch.Tensor, e: int, device: torch.device, arena: Any,
              layouts: Layouts | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Diff every piece, a column ``[new values' address, snapshot's address, n, start]`` of
    ``table`` (host int64; flat tensors of ``e``-byte elements on ``device``), and set each
    snapshot to its new values. Returns what ``cpu.diff_many`` does: a host row
    per piece ``[kind, changed count, digest, offset, bytes]`` (kind: -1 nothing changed, 1
    positions, 2 bitmap, 3 dense: send the values whole) and the room in ``arena`` (on
    ``device``) the bodies lie in, one after the other (taken). :class:`Diff` in one go."""
    return Diff(table, e, device, arena, layouts).finish()


class Diff:
    """A group's diff in flight: pass one launched, every piece's count and digest on their
    way to the host; :meth:`finish` lays the records out and launches pass two. Start the
    next group's before finishing this one, and the GPU diffs it while the host lays out."""

    def __init__(self, table: torch.Tensor, e: int, device: torch.device, arena: Any,
                 layouts: Layouts | None = None) -> None:
        ks = kernels()
        self.e, self.dev, self.arena, self.INT = e, device, arena, _int(ks.tl, e)
        self.n = table[2]
        with _on(device):
            self.cur, snap_tab, self.n_dev, start_tab = table.contiguous().to(device, non_blocking=True)
            self.blocks = blocks = (layouts or Layouts()).get(self.n, device)
            item, off, total = blocks.item, blocks.off, len(blocks.item)
            self.counts = counts = torch.empty(total, dtype=torch.int32, device=device)
            self.scratch = torch.empty(total * (BLOCK // 8), dtype=torch.uint8, device=device)  # the bits
            partial = torch.empty(total, dtype=torch.int64, device=device)
            self.align = 16 if bool(((table[:2] % 16) == 0).all()) else 1
            for b0, count, whole in ((0, blocks.whole, True), (blocks.whole, total - blocks.whole, False)):
                if count:
                    ks.diff[(count,)](self.cur, snap_tab, self.n_dev, start_tab, item, off, counts,
                                      self.scratch, partial, b0, INT=self.INT, BLOCK=BLOCK, ALIGN=self.align,
                                      NARROW=e <= 2, WHOLE=whole, num_warps=WARPS[0])
            # each piece's sums from running sums (an index_add_ over 100,000s of blocks into
            # a few pieces contends on its atomics; 1-D scans: a scan of 2 rows runs far
            # slower); int64 wraps as the digest
            x = torch.stack([counts.to(torch.int64), partial])
            running = torch.stack([torch.cumsum(x[0], 0), torch.cumsum(x[1], 0)])
            self.running = running[0]
            sums = blocks.per_piece(running, x)
            self.done: Any = None
            if device.type == "cuda":
                self.sums = torch.empty(sums.shape, dtype=torch.int64, pin_memory=True)
                self.sums.copy_(sums, non_blocking=True)
                self.done = torch.cuda.Event()
                self.done.record()
            else:
                self.sums = sums

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for pass one; lay out and launch pass two. Returns as :func:`diff_many`."""
        if self.done is not None:
            self.done.synchronize()  # (the one wait; pass two runs while the caller goes on)
        k, digest = self.sums
        n, e = self.n, self.e
        # the kind delta.encode chooses: positions while not larger than a bitmap, dense
        # values where they are no larger than either with the changed values
        bitmap = _pad((n + 7) // 8)
        where = torch.minimum(_pad(4 * k), bitmap)
        kind = torch.where(k == 0, _NONE, torch.where(e * n <= where + e * k, _DENSE,
                                                      torch.where(_pad(4 * k) <= bitmap, _SPARSE, _BITMAP)))
        kept = (kind == _SPARSE) | (kind == _BITMAP)
        nbytes = where + _pad(e * k)
        body = torch.where(kept, nbytes, 0)
        offset = torch.cumsum(body, 0) - body
        used = int(body.sum())
        out = self.arena.room(used)
        if used:
            with _on(self.dev):
                out.zero_()  # (the padding between positions, bitmap and values: zeros, as the torch path)
                lay = torch.stack([kind, out.data_ptr() + offset, out.data_ptr() + offset + where])
                lay = lay.to(self.dev, non_blocking=True)
                item = self.blocks.item
                base = self.blocks.before(self.running)  # (each block's: changes before it in its piece)
                kernels().write[(len(item),)](self.cur, self.n_dev, lay[0], lay[1], lay[2], item,
                                              self.blocks.off, base, self.counts, self.scratch,
                                              self.scratch.view(torch.int32), INT=self.INT, BLOCK=BLOCK,
                                              num_warps=WARPS[1])
        self.arena.take(used)
        return torch.stack([kind, k, digest, offset, nbytes], 1), out


def apply_many(rows: torch.Tensor, device: torch.device, wait: bool = True) -> Any:
    """Write every record, a host row ``[kind, dst address, n, e, start, positions or bitmap
    address, values address, k]`` of ``rows`` (int64, addresses on ``device``, one element
    size). Returns ``[our digest, status]`` per record, on the host, as
    ``cpu.apply_many``: status for positions, -1 or the first position out of
    range; for a bitmap, its set bits (-1: a bit past its n); else 0. ``wait=False``:
    returns at once a function that returns them (the writes and their read-back in
    flight: the caller goes on, to the next round's agreement, while the device works)."""
    with _on(device):
        got = _apply_many(rows, device)
    return got if not wait else got()


def _apply_many(rows: torch.Tensor, device: torch.device) -> Any:
    ks = kernels()
    table = rows.contiguous()
    sizes = table[:, 3].unique()
    if len(sizes) > 1:  # (a launch per element size)
        each = [(table[:, 3] == e).nonzero().squeeze(1) for e in sizes.tolist()]
        parts = [(these, _apply_many(table[these], device)) for these in each]

        def assembled() -> torch.Tensor:
            out = torch.empty(len(table), 2, dtype=torch.int64)
            for these, got in parts:
                out[these] = got()
            return out
        return assembled
    kind, n, e, k = table[:, 0], table[:, 2], int(table[0, 3]), table[:, 7]
    tab = table.to(device, non_blocking=True)
    lay = _WholeFirst(torch.where(kind == _SPARSE, k, n), device)  # (blocks over values, or over n)
    item, off = lay.item, lay.off
    if not len(item):  # (records with nothing to write: a directory may say so)
        empty = torch.stack([torch.zeros_like(kind), torch.where(kind == _SPARSE, -1, 0)], 1)
        return lambda: empty
    grid = (len(item),)
    bits = torch.empty(len(item), dtype=torch.int64, device=device)
    if bool((kind == _BITMAP).any()):
        ks.bitcount[grid](tab, item, off, bits, BLOCK=BLOCK, num_warps=4)
    else:
        bits.zero_()
    partial = torch.empty(len(item), dtype=torch.int64, device=device)
    bad = torch.empty(len(item), dtype=torch.int64, device=device)
    base = lay.before(torch.cumsum(bits, 0))  # (a bitmap block's first value)
    ks.apply[grid](tab, item, off, base, partial, bad, INT=_int(ks.tl, e), BLOCK=BLOCK, num_warps=8)
    R = len(table)
    ours = torch.zeros(R, dtype=torch.int64, device=device).index_add_(0, item, partial)
    got = torch.zeros(R, dtype=torch.int64, device=device).index_add_(0, item, bits)
    worst = torch.full((R,), 1 << 62, dtype=torch.int64, device=device).scatter_reduce_(0, item, bad, "amin")
    back, done = torch.stack([ours, got, worst], 1), None
    if back.is_cuda:  # (read back into pinned memory behind the writes; waited for when asked)
        back, done = torch.empty(R, 3, dtype=torch.int64, pin_memory=True).copy_(back, non_blocking=True), \
            torch.cuda.Event()
        done.record()
    else:  # (Triton's interpreter: done already)
        back = back.cpu()

    def result() -> torch.Tensor:
        if done is not None:
            done.synchronize()
        status = torch.where(kind == _SPARSE, torch.where(back[:, 2] >= 1 << 62, -1, back[:, 2]),
                             torch.where(kind == _BITMAP, back[:, 1].clamp(min=-1), 0))
        return torch.stack([back[:, 0], status], 1)
    return result


_SPAN = 16 * BLOCK  # elements per program of the whole-destination digest (its 32-bit sums allow 16 blocks)


def digests(addr: torch.Tensor, n: torch.Tensor, esize: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Each flat tensor's whole digest, ``sum(w(i) * x[i])`` (host int64 columns of their
    addresses on ``device``, element counts and sizes): a launch per element size, a
    program per ``_SPAN`` elements, on the current stream, nothing waited for. Returns
    int64 on ``device`` (read it when it is needed)."""
    ks = kernels()
    out = torch.zeros(len(n), dtype=torch.int64, device=device)
    with _on(device):
        for e in esize.unique().tolist():
            these = (esize == e).nonzero().squeeze(1)
            spans = (n[these] + _SPAN - 1) // _SPAN
            total = int(spans.sum())
            if not total:
                continue
            item = torch.repeat_interleave(torch.arange(len(these)), spans, output_size=total)
            off = (torch.arange(total) - (torch.cumsum(spans, 0) - spans)[item]) * _SPAN
            k = len(these)
            tab = torch.cat([addr[these], n[these], item, off, these]).to(device, non_blocking=True)
            partial = torch.empty(total, dtype=torch.int64, device=device)
            align = 16 if bool((addr[these] % 16 == 0).all()) else 1
            ks.digest[(total,)](tab[:k], tab[k:2 * k], tab[2 * k:2 * k + total], tab[2 * k + total:-k],
                                partial, INT=_int(ks.tl, e), BLOCK=BLOCK, SPAN=_SPAN, NARROW=e <= 2,
                                ALIGN=align, num_warps=8)
            # (each program's sum into its tensor's: item i is tensor these[i])
            out.index_add_(0, tab[-k:][tab[2 * k:2 * k + total]], partial)
    return out
