"""Delta mode's Triton kernels (launched by :mod:`.delta_gpu`, which says what they do).
Imported only where delta mode runs on a GPU: Triton is slow to import."""

import triton
import triton.language as tl


@triton.jit
def _diff_block(cur, snap, r, rows, lane, left, b, base, counts, scratch, partial, WHOLE: tl.constexpr,
                NARROW: tl.constexpr, BLOCK: tl.constexpr):
    """``diff`` of one block, ``WHOLE`` or the last of its piece (``left`` elements): a
    whole block's accesses are unmasked or masked by rows, so they stay wide."""
    if WHOLE:
        x = tl.load(cur + r)
        y = tl.load(snap + r)
    else:
        x = tl.load(cur + r, mask=r < left, other=0)
        y = tl.load(snap + r, mask=r < left, other=0)
    changed = x != y
    ones = changed.to(tl.int32)
    if WHOLE:  # a row with a change written whole (the rest of it is unchanged): one wide store
        tl.store(snap + r, x, mask=tl.broadcast_to(tl.max(ones, axis=1)[:, None] != 0, (BLOCK // 8, 8)))
    else:
        tl.store(snap + r, x, mask=changed)
    tl.store(scratch + b * (BLOCK // 8) + rows, tl.sum(ones << lane[None, :], axis=1).to(tl.uint8))
    tl.store(counts + b, tl.sum(tl.sum(ones, axis=1), axis=0))
    # sum of w(base + r) * d, w(i) = i * 2654435761 + 1, d = new - old (0 where unchanged):
    # 2654435761 * (base * sum(d) + sum(r * d)) + sum(d); with elements of <= 2 bytes, d and
    # r * d fit 32 bits (|d| < 2^16, r < 2^12), so only the block's sums are 64-bit
    if NARROW:
        d = x.to(tl.int32) - y.to(tl.int32)
        sd = tl.sum(tl.sum(d, axis=1), axis=0).to(tl.int64)
        srd = tl.sum(tl.sum((r * d).to(tl.int64), axis=1), axis=0)
        tl.store(partial + b, (base * sd + srd) * 2654435761 + sd)
    else:
        w = (base + r) * 2654435761 + 1
        terms = tl.where(changed, w * (x.to(tl.int64) - y.to(tl.int64)), 0)
        tl.store(partial + b, tl.sum(tl.sum(terms, axis=1), axis=0))


@triton.jit
def diff(cur_tab, snap_tab, n_tab, start_tab, blk_piece, blk_off, counts, scratch, partial, INT: tl.constexpr,
         BLOCK: tl.constexpr, ALIGN: tl.constexpr, NARROW: tl.constexpr):
    """A block's changed elements: their count, their bits (a bitmap, for ``write``), its
    share of the digest; the new values into the snapshot. Blocks are [BLOCK / 8, 8] (a row
    is a bitmap byte: no reshapes)."""
    b = tl.program_id(0)
    p = tl.load(blk_piece + b)
    off = tl.multiple_of(tl.load(blk_off + b), BLOCK)
    left = tl.load(n_tab + p) - off
    cur = tl.load(cur_tab + p).to(tl.pointer_type(INT))
    snap = tl.load(snap_tab + p).to(tl.pointer_type(INT))
    if ALIGN > 1:  # (every piece 16-byte aligned: 16-byte accesses)
        cur = tl.multiple_of(cur, ALIGN)
        snap = tl.multiple_of(snap, ALIGN)
    rows = tl.arange(0, BLOCK // 8)
    lane = tl.arange(0, 8)
    r = rows[:, None] * 8 + lane[None, :]
    base = tl.load(start_tab + p) + off
    if left >= BLOCK:
        _diff_block(cur + off, snap + off, r, rows, lane, left, b, base, counts, scratch, partial,
                    True, NARROW, BLOCK)
    else:
        _diff_block(cur + off, snap + off, r, rows, lane, left, b, base, counts, scratch, partial,
                    False, NARROW, BLOCK)


@triton.jit
def write(cur_tab, n_tab, kind_tab, where_tab, vals_tab, blk_piece, blk_off, blk_base, counts, scratch,
          INT: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
    """A block's changed elements (from ``diff``'s bits: only their rows are read) into its
    record's body, where it is positions or a bitmap with values (dense: sent from cur)."""
    b = tl.program_id(0)
    if tl.load(counts + b) > 0:
        p = tl.load(blk_piece + b)
        kind = tl.load(kind_tab + p)
        if (kind == 1) | (kind == 2):
            off = tl.multiple_of(tl.load(blk_off + b), BLOCK)
            n = tl.load(n_tab + p)
            rows = tl.arange(0, BLOCK // 8)
            lane = tl.arange(0, 8)
            r = rows[:, None] * 8 + lane[None, :]
            byte = tl.load(scratch + b * (BLOCK // 8) + rows)
            on = ((byte.to(tl.int32)[:, None] >> lane[None, :]) & 1) != 0
            cur = tl.load(cur_tab + p).to(tl.pointer_type(INT))
            if ALIGN > 1:
                cur = tl.multiple_of(cur, ALIGN)
            if off + BLOCK <= n:  # (rows with a change read whole: wide loads)
                row = tl.broadcast_to((byte != 0)[:, None], (BLOCK // 8, 8))
                x = tl.load(cur + off + r, mask=row, other=0)
            else:
                x = tl.load(cur + off + r, mask=on, other=0)
            ones = on.to(tl.int32)
            per_row = tl.sum(ones, axis=1)
            rank = tl.load(blk_base + b) + ((tl.cumsum(per_row, axis=0) - per_row)[:, None]
                                             + tl.cumsum(ones, axis=1) - 1)
            tl.store(tl.load(vals_tab + p).to(tl.pointer_type(INT)) + rank, x, mask=on)
            if kind == 1:
                tl.store(tl.load(where_tab + p).to(tl.pointer_type(tl.int32)) + rank, (off + r).to(tl.int32),
                         mask=on)
            else:
                tl.store(tl.load(where_tab + p).to(tl.pointer_type(tl.uint8)) + off // 8 + rows, byte,
                         mask=off // 8 + rows < (n + 7) // 8)


@triton.jit
def bitcount(rows, blk_rec, blk_off, counts, BLOCK: tl.constexpr):
    """Set bits per block of a bitmap record (else 0), and -1 for a bit past its n."""
    b = tl.program_id(0)
    r = tl.load(blk_rec + b)
    if tl.load(rows + 8 * r) == 2:
        n = tl.load(rows + 8 * r + 2)
        off = tl.load(blk_off + b)
        byte = off // 8 + tl.arange(0, BLOCK // 8)
        v = tl.load(tl.load(rows + 8 * r + 5).to(tl.pointer_type(tl.uint8)) + byte,
                    mask=byte < (n + 7) // 8, other=0).to(tl.int32)
        i = byte[:, None] * 8 + tl.arange(0, 8)[None, :]
        on = ((v[:, None] >> tl.arange(0, 8)[None, :]) & 1) != 0
        past = tl.sum((on & (i >= n)).to(tl.int32))
        got = tl.sum(tl.sum(on.to(tl.int64), axis=1), axis=0)
        tl.store(counts + b, tl.where(past > 0, -(1 << 40), got))
    else:
        tl.store(counts + b, 0)


@triton.jit
def apply(rows, blk_rec, blk_off, blk_base, partial, first_bad, INT: tl.constexpr,
          BLOCK: tl.constexpr):
    """A block of a record: values over [off, off + BLOCK) of its n (full, dense and
    bitmap records) or of its k (sparse ones)."""
    b = tl.program_id(0)
    r = tl.load(blk_rec + b)
    kind = tl.load(rows + 8 * r)
    dst = tl.load(rows + 8 * r + 1).to(tl.pointer_type(INT))
    n = tl.load(rows + 8 * r + 2)
    start = tl.load(rows + 8 * r + 4)
    where = tl.load(rows + 8 * r + 5)
    vals = tl.load(rows + 8 * r + 6).to(tl.pointer_type(INT))
    k = tl.load(rows + 8 * r + 7)
    off = tl.load(blk_off + b)
    j = off + tl.arange(0, BLOCK)
    big = 1 << 62
    if kind == 1:
        take = j < k
        pos = tl.load(where.to(tl.pointer_type(tl.int32)) + j, mask=take, other=0).to(tl.int64)
        bad = take & ((pos < 0) | (pos >= n))
        tl.store(first_bad + b, tl.min(tl.where(bad, j, big), axis=0))
        take = take & ~bad
        x = tl.load(vals + j, mask=take, other=0)
        old = tl.load(dst + pos, mask=take, other=0)
        tl.store(dst + pos, x, mask=take)
        w = (start + pos) * 2654435761 + 1
    elif kind == 2:
        tl.store(first_bad + b, big)
        byte = tl.load(where.to(tl.pointer_type(tl.uint8)) + j // 8, mask=j < n, other=0).to(tl.int32)
        on = (((byte >> (j % 8)) & 1) != 0) & (j < n)
        rank = tl.load(blk_base + b) + tl.cumsum(on.to(tl.int64), axis=0) - 1
        take = on & (rank < k)
        x = tl.load(vals + rank, mask=take, other=0)
        old = tl.load(dst + j, mask=take, other=0)
        tl.store(dst + j, x, mask=take)
        w = (start + j) * 2654435761 + 1
    else:
        tl.store(first_bad + b, big)
        take = j < n
        x = tl.load(vals + j, mask=take, other=0)
        old = tl.load(dst + j, mask=take, other=0)
        tl.store(dst + j, x, mask=take)
        w = (start + j) * 2654435761 + 1
        take = take & (kind == 3)  # (a full record has no digest)
    tl.store(partial + b, tl.sum(tl.where(take, w * (x.to(tl.int64) - old.to(tl.int64)), 0), axis=0))
