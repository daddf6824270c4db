"""Delta mode's GPU kernels (Triton): the trainer's diff and the receiver's apply over many
tensors per launch, where torch's ops cost a dozen launches and a wait per record (an 8b
model's update took 4.6x the dense one on 2xH200, a 30b MoE's 52x).

Every launch covers many pieces through tables of their addresses (multi-tensor, as fused
optimizers do): a program takes ``BLOCK`` elements of one piece. The trainer's diff is two
launches per group of pieces and one wait for the device (:class:`Diff`):

1. *diff*: each block reads the new values and the snapshot once (16 bytes at a time),
   keeps its changed elements' bits (a bitmap) and count, sums its share of the digest and
   writes the new values into the snapshot; one wait, for every piece's count and digest,
   from which the host chooses each record's kind (positions, bitmap or dense values; the
   choice of :func:`delta.encode`) and lays the bodies out, one after the other, in an
   arena kept between updates;
2. *write*: each block of a positions or bitmap record reads its bits and the rows of new
   values with a change, and writes the positions (at the block's prefix of the piece's
   count) or the bitmap bytes, and the values; nothing waits for it (the bucket's copy
   comes after it on the stream). The next group's pass one is launched before this
   group's layout, so the GPU works while the host lays out.

The receiver's apply is two launches per bucket (bitmap records count their set bits per
block first, so each block knows where its values start) and one wait for the digests and
statuses. The records are the C kernels' and the torch path's, bit for bit
(tests/test_delta.py checks them under Triton's interpreter, and on a GPU where there is
one). Without Triton, or with ``WEIGHTBUS_DELTA_KERNELS=0``, GPUs use the torch path.

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

BLOCK = 4096  # elements per program (a multiple of 8: a block's bitmap is whole bytes)
WARPS = [8, 4]  # warps per program of the diff and the write (the fastest on an H100)
_FULL, _SPARSE, _BITMAP, _DENSE, _NONE = 0, 1, 2, 3, -1  # as delta.py's kinds
_lock = threading.Lock()
_kernels: Any = None
_tried = False


def _load() -> Any:
    from weightbus.engines import delta_triton  # (Triton imported on first use: slow to import)

    return delta_triton


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


def _blocks(sizes: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For items of ``sizes`` elements (a host tensor): the item of every block, the block's
    first element in its item, and the index of each item's first block (on ``device``)."""
    per = (sizes + BLOCK - 1) // BLOCK
    per_d = per.to(device, non_blocking=True)
    total = int(per.sum())
    item = torch.repeat_interleave(torch.arange(len(sizes), device=device), per_d, output_size=total)
    first = torch.cumsum(per_d, 0) - per_d
    off = (torch.arange(total, device=device) - first[item]) * BLOCK
    return item, off, first


def _prefix(before: torch.Tensor, item: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Each block's sum of the blocks before it in its item, from ``before``, its sum of
    all blocks before it (an item of no blocks may have its first block past the end:
    never read, so clamped)."""
    return before - before[first.clamp(max=len(before) - 1)][item]


def _pad(n: torch.Tensor) -> torch.Tensor:
    return (n + 7) // 8 * 8


def _on(device: torch.device) -> Any:
    """Launches on ``device`` (Triton launches on the current device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def diff_many(table: torch.Tensor, e: int, device: torch.device, arena: Any
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Diff every piece, a column ``[new values' address, snapshot's address, n, start]`` of
    ``table`` (host int64; flat tensors of ``e``-byte elements on ``device``), and set each
    snapshot to its new values. Returns what ``delta_kernels.diff_many`` does: a host row
    per piece ``[kind, changed count, digest, offset, bytes]`` (kind: -1 nothing changed, 1
    positions, 2 bitmap, 3 dense: send the values whole) and the room in ``arena`` (on
    ``device``) the bodies lie in, one after the other (taken). :class:`Diff` in one go."""
    return Diff(table, e, device, arena).finish()


class Diff:
    """A group's diff in flight: pass one launched, every piece's count and digest on their
    way to the host; :meth:`finish` lays the records out and launches pass two. Start the
    next group's before finishing this one, and the GPU diffs it while the host lays out."""

    def __init__(self, table: torch.Tensor, e: int, device: torch.device, arena: Any) -> None:
        ks = kernels()
        self.e, self.dev, self.arena, self.INT = e, device, arena, _int(ks.tl, e)
        self.n = table[2]
        with _on(device):
            self.cur, snap_tab, self.n_dev, start_tab = table.contiguous().to(device, non_blocking=True)
            item, off, first = self.item, self.off, self.first = _blocks(self.n, device)
            self.counts = counts = torch.empty(len(item), dtype=torch.int32, device=device)
            self.scratch = torch.empty(len(item) * (BLOCK // 8), dtype=torch.uint8, device=device)  # the bits
            partial = torch.empty(len(item), dtype=torch.int64, device=device)
            self.align = 16 if bool(((table[:2] % 16) == 0).all()) else 1
            ks.diff[(len(item),)](self.cur, snap_tab, self.n_dev, start_tab, item, off, counts, self.scratch,
                                  partial, INT=self.INT, BLOCK=BLOCK, ALIGN=self.align, NARROW=e <= 2,
                                  num_warps=WARPS[0])
            # each piece's sums as differences of running sums (an index_add_ over 100,000s
            # of blocks into a few pieces contends on its atomics); int64 wraps as the digest
            last = torch.cat([first[1:], torch.full_like(first[:1], len(item))]) - 1
            self.before = before = torch.cumsum(counts, 0, dtype=torch.int64) - counts  # (blocks before)
            digests = torch.cumsum(partial, 0)  # (1-D scans: a scan of 2 rows runs far slower)
            sums = torch.stack([before[last] + counts[last] - before[first],
                                digests[last] - digests[first] + partial[first]])
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
                item, first = self.item, self.first
                base = _prefix(self.before, item, first)  # (each block's: those before it in its piece)
                kernels().write[(len(item),)](self.cur, self.n_dev, lay[0], lay[1], lay[2], item, self.off,
                                              base, self.counts, self.scratch, INT=self.INT, BLOCK=BLOCK,
                                              ALIGN=self.align, num_warps=WARPS[1])
        self.arena.take(used)
        return torch.stack([kind, k, digest, offset, nbytes], 1), out


def apply_many(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Write every record, a host row ``[kind, dst address, n, e, start, positions or bitmap
    address, values address, k]`` of ``rows`` (int64, addresses on ``device``, one element
    size). Returns ``[our digest, status]`` per record, on the host, as
    ``delta_kernels.apply_many``: status for positions, -1 or the first position out of
    range; for a bitmap, its set bits (-1: a bit past its n); else 0."""
    with _on(device):
        return _apply_many(rows, device)


def _apply_many(rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    ks = kernels()
    table = rows.contiguous()
    sizes = table[:, 3].unique()
    if len(sizes) > 1:  # (a launch per element size)
        out = torch.empty(len(table), 2, dtype=torch.int64)
        for e in sizes.tolist():
            these = (table[:, 3] == e).nonzero().squeeze(1)
            out[these] = _apply_many(table[these], device)
        return out
    kind, n, e, k = table[:, 0], table[:, 2], int(table[0, 3]), table[:, 7]
    tab = table.to(device, non_blocking=True)
    item, off, first = _blocks(torch.where(kind == _SPARSE, k, n), device)
    if not len(item):  # (records with nothing to write: a directory may say so)
        return torch.stack([torch.zeros_like(kind), torch.where(kind == _SPARSE, -1, 0)], 1)
    grid = (len(item),)
    bits = torch.empty(len(item), dtype=torch.int64, device=device)
    if bool((kind == _BITMAP).any()):
        ks.bitcount[grid](tab, item, off, bits, BLOCK=BLOCK, num_warps=4)
    else:
        bits.zero_()
    partial = torch.empty(len(item), dtype=torch.int64, device=device)
    bad = torch.empty(len(item), dtype=torch.int64, device=device)
    base = _prefix(torch.cumsum(bits, 0) - bits, item, first)  # (a bitmap block's first value)
    ks.apply[grid](tab, item, off, base, partial, bad, INT=_int(ks.tl, e), BLOCK=BLOCK, num_warps=8)
    R = len(table)
    ours = torch.zeros(R, dtype=torch.int64, device=device).index_add_(0, item, partial)
    got = torch.zeros(R, dtype=torch.int64, device=device).index_add_(0, item, bits)
    worst = torch.full((R,), 1 << 62, dtype=torch.int64, device=device).scatter_reduce_(0, item, bad, "amin")
    out = torch.stack([ours, got, worst], 1).cpu()
    status = torch.where(kind == _SPARSE, torch.where(out[:, 2] >= 1 << 62, -1, out[:, 2]),
                         torch.where(kind == _BITMAP, out[:, 1].clamp(min=-1), 0))
    return torch.stack([out[:, 0], status], 1)
