"""Delta mode's Triton kernels (launched by :mod:`.gpu`, which says what they do).
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
    # r * d fit 32 bits (|d| < 2^16, r < 2^12), and so does a row's sum of 8 r * d (< 2^31):
    # only the sums over rows are 64-bit
    if NARROW:
        d = x.to(tl.int32) - y.to(tl.int32)
        sd = tl.sum(tl.sum(d, axis=1), axis=0).to(tl.int64)
        srd = tl.sum(tl.sum(r * d, axis=1).to(tl.int64), axis=0)
        tl.store(partial + b, (base * sd + srd) * 2654435761 + sd)
    else:
        tl.store(partial + b, tl.sum(tl.sum(_terms(changed, base + r, x, y), axis=1), axis=0))


@triton.jit
def _terms(take, at, new, old):
    """Digest terms, w(at) * (new - old) where ``take`` (else 0), w(i) = i * 2654435761 + 1:
    the receivers' check sums them per record as the trainer does."""
    return tl.where(take, (at * 2654435761 + 1) * (new.to(tl.int64) - old.to(tl.int64)), 0)


@triton.jit
def diff(cur_tab, snap_tab, n_tab, start_tab, blk_piece, blk_off, counts, scratch, partial, b0,
         INT: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr, NARROW: tl.constexpr,
         WHOLE: tl.constexpr):
    """A block's changed elements: their count, their bits (a bitmap, for ``write``), its
    share of the digest; the new values into the snapshot. Blocks are [BLOCK / 8, 8] (a row
    is a bitmap byte: no reshapes). Program i takes block ``b0 + i``: whole blocks in one
    launch, the pieces' partial last blocks in another (one kernel body with both, chosen
    per block, ran 1.3x slower on an H200)."""
    b = b0 + tl.program_id(0)
    p = tl.load(blk_piece + b)
    off = tl.multiple_of(tl.load(blk_off + b), BLOCK)
    cur = tl.load(cur_tab + p).to(tl.pointer_type(INT))
    snap = tl.load(snap_tab + p).to(tl.pointer_type(INT))
    if ALIGN > 1:  # (every piece 16-byte aligned: 16-byte accesses)
        cur = tl.multiple_of(cur, ALIGN)
        snap = tl.multiple_of(snap, ALIGN)
    rows = tl.arange(0, BLOCK // 8)
    lane = tl.arange(0, 8)
    r = rows[:, None] * 8 + lane[None, :]
    base = tl.load(start_tab + p) + off
    _diff_block(cur + off, snap + off, r, rows, lane, tl.load(n_tab + p) - off, b, base, counts, scratch,
                partial, WHOLE, NARROW, BLOCK)


@triton.jit
def _popcount(x):
    """Set bits of each int32 (SWAR: no intrinsic, so Triton's interpreter runs it too)."""
    x = x - ((x >> 1) & 0x55555555)  # (masked after each shift: arithmetic shifts are harmless)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return ((x * 0x01010101) >> 24) & 0xFF


@triton.jit
def _lowest(w):
    """Each word's lowest set bit's position (32 where none) and the word without it."""
    low = w & -w
    return _popcount(low - 1), w ^ low


@triton.jit
def write(cur_tab, n_tab, kind_tab, where_tab, vals_tab, blk_piece, blk_off, blk_base, counts, scratch,
          words, INT: tl.constexpr, BLOCK: tl.constexpr):
    """A block's changed elements (from ``diff``'s bits) into its record's body, where it is
    positions or a bitmap with values (dense: sent from cur). Work follows the changes, not
    the elements: a lane per 32-bit word of bits takes its lowest set bit per step, as many
    steps as the block's fullest word has bits (2 % changed: ~4 steps of 128 lanes, where a
    pass over the 4,096 elements with a block-wide scan of them took 4x the bytes' time)."""
    b = tl.program_id(0)
    if tl.load(counts + b) > 0:
        p = tl.load(blk_piece + b)
        kind = tl.load(kind_tab + p)
        if (kind == 1) | (kind == 2):
            off = tl.load(blk_off + b)
            i = tl.arange(0, BLOCK // 32)
            w = tl.load(words + b * (BLOCK // 32) + i)  # (bit k of word i: element 32 i + k)
            c = _popcount(w)
            rank = tl.load(blk_base + b) + tl.cumsum(c, axis=0) - c  # (each word's first value)
            first = off + i * 32
            cur = tl.load(cur_tab + p).to(tl.pointer_type(INT))
            vals = tl.load(vals_tab + p).to(tl.pointer_type(INT))
            where = tl.load(where_tab + p)
            for _ in range(tl.max(c, axis=0)):
                on = w != 0
                bit, w = _lowest(w)
                j = first + bit
                tl.store(vals + rank, tl.load(cur + j, mask=on), mask=on)
                if kind == 1:
                    tl.store(where.to(tl.pointer_type(tl.int32)) + rank, j.to(tl.int32), mask=on)
                rank += 1
            if kind == 2:
                n = tl.load(n_tab + p)
                rows = off // 8 + tl.arange(0, BLOCK // 8)
                byte = tl.load(scratch + b * (BLOCK // 8) + tl.arange(0, BLOCK // 8))
                tl.store(where.to(tl.pointer_type(tl.uint8)) + rows, byte, mask=rows < (n + 7) // 8)


@triton.jit
def _bitmap_words(bitmap, n, off, BLOCK: tl.constexpr):
    """The 32-bit words of a bitmap over elements [off, off + BLOCK) (a multiple of 32):
    bit k of word i is element off + 32 i + k; bytes past the bitmap's (n + 7) // 8 read as
    0. Assembled from bytes: a bitmap in a bucket need not be 4-byte aligned."""
    i = tl.arange(0, BLOCK // 32)
    byte = off // 8 + i[:, None] * 4 + tl.arange(0, 4)[None, :]
    v = tl.load(bitmap + byte, mask=byte < (n + 7) // 8, other=0).to(tl.int32)
    return tl.sum(v << (tl.arange(0, 4)[None, :] * 8), axis=1)


@triton.jit
def _below(v):
    """Int32 words whose low ``v`` bits are set (``v`` clamped to [0, 32]; no shift by 32)."""
    v = tl.minimum(tl.maximum(v, 0), 32).to(tl.int32)
    return tl.where(v >= 32, -1, (1 << tl.minimum(v, 31)) - 1)


@triton.jit
def bitcount(rows, blk_rec, blk_off, counts, BLOCK: tl.constexpr):
    """Set bits per block of a bitmap record (else 0), and -(2^40) for a bit past its n."""
    b = tl.program_id(0)
    r = tl.load(blk_rec + b)
    if tl.load(rows + 8 * r) == 2:
        n = tl.load(rows + 8 * r + 2)
        off = tl.load(blk_off + b)
        w = _bitmap_words(tl.load(rows + 8 * r + 5).to(tl.pointer_type(tl.uint8)), n, off, BLOCK)
        past = w & ~_below(n - off - tl.arange(0, BLOCK // 32) * 32)
        got = tl.sum(_popcount(w).to(tl.int64), axis=0)
        tl.store(counts + b, tl.where(tl.sum((past != 0).to(tl.int32), axis=0) > 0, -(1 << 40), got))
    else:
        tl.store(counts + b, 0)


@triton.jit
def _apply_bitmap(dst, n, start, bitmap, vals, k, off, base, BLOCK: tl.constexpr):
    """``apply`` of a bitmap record's block, as ``write`` takes bits: a lane per 32-bit word,
    a step per bit of the block's fullest word. Returns the block's share of the digest."""
    i = tl.arange(0, BLOCK // 32)
    w = _bitmap_words(bitmap, n, off, BLOCK) & _below(n - off - i * 32)  # (bits past n: never written)
    c = _popcount(w)
    rank = base + (tl.cumsum(c, axis=0) - c).to(tl.int64)
    first = off + i * 32
    acc = tl.zeros((BLOCK // 32,), dtype=tl.int64)
    for _ in range(tl.max(c, axis=0)):
        take = (w != 0) & (rank < k)
        bit, w = _lowest(w)
        j = first + bit
        x = tl.load(vals + rank, mask=take, other=0)
        old = tl.load(dst + j, mask=take, other=0)
        tl.store(dst + j, x, mask=take)
        acc += _terms(take, start + j, x, old)
        rank += 1
    return tl.sum(acc, axis=0)


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
        part = tl.sum(_terms(take, start + pos, x, old), axis=0)
    elif kind == 2:
        tl.store(first_bad + b, big)
        part = _apply_bitmap(dst, n, start, where.to(tl.pointer_type(tl.uint8)), vals, k, off,
                             tl.load(blk_base + b), BLOCK)
    else:
        tl.store(first_bad + b, big)
        take = j < n
        x = tl.load(vals + j, mask=take, other=0)
        old = tl.load(dst + j, mask=take, other=0)
        tl.store(dst + j, x, mask=take)
        part = tl.sum(_terms(take & (kind == 3), start + j, x, old), axis=0)  # (a full record: no digest)
    tl.store(partial + b, part)


@triton.jit
def digest(addr_tab, n_tab, blk_item, blk_off, partial, INT: tl.constexpr, BLOCK: tl.constexpr,
           SPAN: tl.constexpr, NARROW: tl.constexpr, ALIGN: tl.constexpr):
    """The check of whole destinations: a program sums w(j) * x[j] over SPAN elements of
    one tensor from ``off`` (BLOCK at a time; few programs, so tables made per call stay
    small), the host adds each tensor's programs. NARROW (elements of at most 2 bytes):
    w(off + u) = w(off) + 2654435761 u, so the sum is w(off) * sum(x) + 2654435761 * sum(u
    x), and with u = BLOCK q + t, sum(u x) = BLOCK sum(q x) + sum(t x) is had from two
    32-bit sums per lane, no multiply per element (``_narrow``): a 64-bit multiply per
    element bound the kernel at ~10x a read of the bytes on an H100, 32-bit ones at ~2x."""
    b = tl.program_id(0)
    r = tl.load(blk_item + b)
    x_ptr = tl.load(addr_tab + r).to(tl.pointer_type(INT))
    if ALIGN > 1:  # (every tensor 16-byte aligned: whole spans are read 16 bytes at a time)
        x_ptr = tl.multiple_of(x_ptr, ALIGN)
    n = tl.load(n_tab + r)
    off = tl.multiple_of(tl.load(blk_off + b), SPAN)
    if NARROW:
        t = tl.arange(0, BLOCK)
        if off + SPAN <= n:  # (a whole span: no masks, so the loads stay wide)
            s1, cc = _narrow(x_ptr + off, t, n - off, BLOCK, SPAN, False)
        else:
            s1, cc = _narrow(x_ptr + off, t, n - off, BLOCK, SPAN, True)
        # per lane, sum over q of q x = Q s1 - cc (Q = SPAN / BLOCK); then sum(t x) = sum(t s1)
        q_x = tl.sum(((SPAN // BLOCK) * s1 - cc).to(tl.int64), axis=0)
        t_x = tl.sum(t.to(tl.int64) * s1.to(tl.int64), axis=0)
        total = (off * 2654435761 + 1) * tl.sum(s1.to(tl.int64), axis=0) + 2654435761 * (BLOCK * q_x + t_x)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for k in range(0, SPAN, BLOCK):
            j = off + k + tl.arange(0, BLOCK)
            take = j < n
            x = tl.load(x_ptr + j, mask=take, other=0)
            acc += _terms(take, j, x, tl.zeros_like(x))
        total = tl.sum(acc, axis=0)
    tl.store(partial + b, total)


@triton.jit
def _narrow(x_ptr, t, left, BLOCK: tl.constexpr, SPAN: tl.constexpr, MASKED: tl.constexpr):
    """Per lane t, over the SPAN / BLOCK steps q: s1 = sum of x[q, t], and cc = the sum of
    s1 after each step (sum of x[q, t] (Q - q)), both in 32-bit lanes: |x| < 2^15 and Q <=
    16 keep |cc| < 2^23."""
    s1 = tl.zeros([BLOCK], dtype=tl.int32)
    cc = tl.zeros([BLOCK], dtype=tl.int32)
    for q in range(0, SPAN // BLOCK):
        u = q * BLOCK + t
        if MASKED:
            x = tl.load(x_ptr + u, mask=u < left, other=0).to(tl.int32)
        else:
            x = tl.load(x_ptr + u).to(tl.int32)
        s1 += x
        cc += s1
    return s1, cc
