/* Delta mode's CPU kernels (weightbus/engines/delta/cpu.py builds and loads them).
 *
 * Why C: on a CPU, torch takes a diff in ~10 passes over memory (compare, nonzero, gathers,
 * digest, snapshot update), and its nonzero/masked ops run at a fraction of memory speed.
 * These do it in one pass: the trainer's diff reads the new values and the snapshot once,
 * the receiver's apply touches only the changed elements.
 *
 * Elements are integers of width e (1, 2, 4 or 8 bytes): the bit patterns of the wire
 * dtype. The digest of a patch is sum(w(pos) * (new - old)) in wrapping 64-bit arithmetic,
 * w(pos) = pos * 2654435761 + 1, new and old read as unsigned for e == 1 and signed
 * otherwise (as delta.py's torch path does).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline uint64_t load(const uint8_t *p, int e) {
    switch (e) {
    case 1: return *p;
    case 2: { int16_t v; memcpy(&v, p, 2); return (uint64_t)(int64_t)v; }
    case 4: { int32_t v; memcpy(&v, p, 4); return (uint64_t)(int64_t)v; }
    default: { uint64_t v; memcpy(&v, p, 8); return v; }
    }
}

static inline uint64_t weight(int64_t pos) { return (uint64_t)pos * 2654435761u + 1u; }

/* Which of 64 bytes differ: bit q for byte q. */
#if defined(__SSE2__)
#include <emmintrin.h>
static inline uint64_t changed_bytes(const uint8_t *a, const uint8_t *b) {
    uint64_t same = 0;
    for (int q = 0; q < 4; q++) {
        __m128i x = _mm_loadu_si128((const __m128i *)(a + 16 * q));
        __m128i y = _mm_loadu_si128((const __m128i *)(b + 16 * q));
        same |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)) << (16 * q);
    }
    return ~same;
}
#else
static inline uint64_t changed_bytes(const uint8_t *a, const uint8_t *b) {
    uint64_t x = 0, m = 0;
    for (int q = 0; q < 64; q++) x |= (uint64_t)(a[q] ^ b[q]);
    if (!x) return 0; /* the common case, without a branch per byte */
    for (int q = 0; q < 64; q++) m |= (uint64_t)(a[q] != b[q]) << q;
    return m;
}
#endif

/* Move k positions to the bitmap of n bits, which may share their memory. 0: no memory. */
static int to_bitmap(const int32_t *pos, int64_t k, uint8_t *bitmap, int64_t n) {
    int32_t *copy = malloc((size_t)(k > 0 ? k : 1) * sizeof(int32_t));
    if (!copy) return 0;
    memcpy(copy, pos, (size_t)k * sizeof(int32_t));
    memset(bitmap, 0, (size_t)((n + 7) / 8));
    for (int64_t j = 0; j < k; j++) bitmap[copy[j] >> 3] |= (uint8_t)(1u << (copy[j] & 7));
    free(copy);
    return 1;
}

/* One changed element i: its value, position (or bit) and digest term; the snapshot takes
 * the new value. Past cap positions, they move to the bitmap. */
#define TAKE(E, i)                                                                              \
    do {                                                                                        \
        const uint8_t *np_ = cur + (i) * (E);                                                   \
        uint8_t *op_ = snap + (i) * (E);                                                        \
        sum += weight(start + (i)) * (load(np_, E) - load(op_, E));                             \
        memcpy(vals + k * (E), np_, E);                                                         \
        memcpy(op_, np_, E);                                                                    \
        if (k == cap && !to_bitmap(pos, k, bitmap, n)) return -1; /* (pos, bitmap: the same room) */ \
        if (k >= cap) bitmap[(i) >> 3] |= (uint8_t)(1u << ((i) & 7));                           \
        else pos[k] = (int32_t)(i);                                                             \
        k++;                                                                                    \
    } while (0)

/* Which of 64 elements of E bytes differ: bit j for element j. Vectorized where SSE2 is
 * (the compares of 16 bytes packed down to a bit per element), else left to the compiler. */
#define CHANGED_SCALAR(E, T)                                                                    \
    static inline uint64_t changed_##E(const uint8_t *a, const uint8_t *b) {                    \
        uint64_t m = 0;                                                                         \
        for (int j = 0; j < 64; j++) {                                                          \
            T x, y;                                                                             \
            memcpy(&x, a + j * (E), E);                                                         \
            memcpy(&y, b + j * (E), E);                                                         \
            m |= (uint64_t)(x != y) << j;                                                       \
        }                                                                                       \
        return m;                                                                               \
    }
#if defined(__SSE2__)
static inline __m128i eq16(const uint8_t *a, const uint8_t *b) {
    return _mm_cmpeq_epi16(_mm_loadu_si128((const __m128i *)a), _mm_loadu_si128((const __m128i *)b));
}
static inline __m128i eq32(const uint8_t *a, const uint8_t *b) {
    return _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)a), _mm_loadu_si128((const __m128i *)b));
}
static inline uint64_t changed_1(const uint8_t *a, const uint8_t *b) { return changed_bytes(a, b); }
static inline uint64_t changed_2(const uint8_t *a, const uint8_t *b) {
    uint64_t same = 0;
    for (int q = 0; q < 4; q++, a += 32, b += 32)
        same |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_packs_epi16(eq16(a, b), eq16(a + 16, b + 16))) << (16 * q);
    return ~same;
}
static inline uint64_t changed_4(const uint8_t *a, const uint8_t *b) {
    uint64_t same = 0;
    for (int q = 0; q < 4; q++, a += 64, b += 64) {
        __m128i lo = _mm_packs_epi32(eq32(a, b), eq32(a + 16, b + 16));
        __m128i hi = _mm_packs_epi32(eq32(a + 32, b + 32), eq32(a + 48, b + 48));
        same |= (uint64_t)(uint16_t)_mm_movemask_epi8(_mm_packs_epi16(lo, hi)) << (16 * q);
    }
    return ~same;
}
#else
CHANGED_SCALAR(1, uint8_t)
CHANGED_SCALAR(2, uint16_t)
CHANGED_SCALAR(4, uint32_t)
#endif
CHANGED_SCALAR(8, uint64_t)

/* Groups of 64 elements whose changes are listed before any is taken: the loop over them
 * ends once per chunk, not once per group (at a few % changed, whether a group has a change
 * is a coin toss, and a mispredicted branch costs more than the group's compare). */
#define CHUNK 16

/* Lists the set bits j of m as r + j at at[0..count), returns the count: the first `ahead`
 * written whatever the count (a slot past it gets a stray value; at[] has room for `ahead`
 * past the count), so the common case has no branch; the rest, rare, in a loop. */
static inline int list_bits(uint64_t m, int r, int32_t *at, int ahead) {
    const int c = __builtin_popcountll(m);
    for (int q = 0; q < ahead; q++) {
        at[q] = r + __builtin_ctzll(m | 1ull << 63); /* (an empty mask: 63) */
        m &= m - 1;
    }
    for (int q = ahead; q < c; q++) {
        at[q] = r + __builtin_ctzll(m);
        m &= m - 1;
    }
    return c;
}

/* The diff for E-byte elements: a chunk's groups compared (vectorized), the positions of
 * their changes listed (four per group written whatever the count, the list advanced by the
 * count: no branch in the common case), then each change taken. 0.5 GiB of bf16 at 2 %
 * changed, one core: 68 ms with a loop per 64 bytes over their changes, 33 ms so (a compare
 * alone: 27 ms). */
#define DIFF(E)                                                                                 \
    static int64_t diff_##E(const uint8_t *cur, uint8_t *snap, int64_t n, int64_t start,        \
                            int32_t *pos, int64_t cap, uint8_t *bitmap, uint8_t *vals,          \
                            uint64_t *digest) {                                                 \
        const int64_t whole = n / 64 * 64;                                                      \
        int32_t at[CHUNK * 64 + 4];                                                             \
        uint64_t sum = 0;                                                                       \
        int64_t k = 0;                                                                          \
        for (int64_t c0 = 0; c0 < whole; c0 += CHUNK * 64) {                                    \
            const int64_t c1 = whole - c0 < CHUNK * 64 ? whole : c0 + CHUNK * 64;               \
            int t = 0;                                                                          \
            for (int64_t g = c0; g < c1; g += 64)                                               \
                t += list_bits(changed_##E(cur + g * (E), snap + g * (E)), (int)(g - c0), at + t, 4); \
            for (int q = 0; q < t; q++) {                                                       \
                const int64_t i = c0 + at[q];                                                   \
                TAKE(E, i);                                                                     \
            }                                                                                   \
        }                                                                                       \
        for (int64_t i = whole; i < n; i++)                                                     \
            if (memcmp(cur + i * (E), snap + i * (E), E)) TAKE(E, i);                          \
        *digest = sum;                                                                          \
        return k;                                                                               \
    }

DIFF(1)
DIFF(2)
DIFF(4)
DIFF(8)

#define BY_WIDTH(e, CALL) \
    switch (e) { case 1: CALL(1); break; case 2: CALL(2); break; case 4: CALL(4); break; default: CALL(8); }

static inline int64_t pad8(int64_t n) { return (n + 7) / 8 * 8; }

/* Diff n elements of cur against snap; write snap = cur; encode the changes into out (room
 * for pad8((n + 7) / 8) + n * e bytes) as the body of a record: their positions (int32,
 * from 0) while there are at most cap of them, else a bitmap ((n + 7) / 8 bytes, bit i % 8
 * of byte i / 8 for element i), each padded to 8 bytes, then their values, padded.
 * Returns the count (-1: out of memory); *digest gets the digest (positions counted from
 * start) and *body the body's bytes. */
static int64_t diff_one(const uint8_t *cur, uint8_t *snap, int64_t n, int e, int64_t start,
                        int64_t cap, uint8_t *out, int64_t *digest, int64_t *body) {
    const int64_t bits = pad8((n + 7) / 8);
    int32_t *pos = (int32_t *)out; /* 4 * cap <= bits: the positions fit where a bitmap would */
    uint8_t *vals = out + bits;
    uint64_t sum = 0;
    int64_t k = 0;
#define CALL(E) k = diff_##E(cur, snap, n, start, pos, cap, out, vals, &sum)
    BY_WIDTH(e, CALL)
#undef CALL
    if (k < 0) return k;
    const int64_t where = k > cap ? bits : pad8(4 * k);
    memset(out + (k > cap ? (n + 7) / 8 : 4 * k), 0, (size_t)(where - (k > cap ? (n + 7) / 8 : 4 * k)));
    memmove(out + where, vals, (size_t)(k * e));
    memset(out + where + k * e, 0, (size_t)(pad8(k * e) - k * e));
    *digest = (int64_t)sum;
    *body = where + pad8(k * e);
    return k;
}

enum { KIND_FULL = 0, KIND_SPARSE = 1, KIND_BITMAP = 2, KIND_DENSE = 3, KIND_DIGEST = 4, KIND_NONE = -1 };

/* Diff count pieces, one call for many (a call per piece costs more than a small piece's
 * diff). Row i of rows: cur, snap (addresses), n, e, start, cap. The bodies go one after
 * the other into out (room bytes: at least the sum of pad8((n + 7) / 8) + n * e); row i of
 * results: kind (KIND_NONE: nothing changed; KIND_DENSE: the values whole are smaller, sent
 * from cur, no body kept), count, digest, offset of its body in out, its bytes. Returns
 * the bytes of out used, or -1 (out of memory). */
int64_t wb_diff_many(int64_t count, const int64_t *rows, uint8_t *out, int64_t room, int64_t *results) {
    int64_t used = 0;
    for (int64_t r = 0; r < count; r++) {
        const int64_t *row = rows + 6 * r;
        const int64_t n = row[2], e = row[3], cap = row[5];
        int64_t *res = results + 5 * r, digest = 0, body = 0;
        if (used + pad8((n + 7) / 8) + n * e > room) return -1;
        const int64_t k = diff_one((const uint8_t *)(intptr_t)row[0], (uint8_t *)(intptr_t)row[1], n, (int)e,
                                   row[4], cap, out + used, &digest, &body);
        if (k < 0) return -1;
        /* as delta.py's torch path chooses: dense where e n <= the positions (or bitmap) + values */
        const int kind = k == 0 ? KIND_NONE
                       : e * n <= body - pad8(e * k) + e * k ? KIND_DENSE
                       : k > cap ? KIND_BITMAP : KIND_SPARSE;
        res[0] = kind, res[1] = k, res[2] = digest, res[3] = used, res[4] = body;
        if (kind == KIND_SPARSE || kind == KIND_BITMAP) used += body;
    }
    return used;
}

/* Changes ahead whose destination is prefetched: at a few % changed, the next one lies a
 * few cache lines on, too far apart for the hardware's prefetcher, and the apply waited on
 * memory (0.5 GiB of bf16 at 2 %: 47 ms without, 22 ms with, one core). */
#define AHEAD 64

/* Whole 64-bit words of a bitmap of nbytes read as words (where bytes lie little-endian in
 * a word; elsewhere none: read byte by byte). A word at a time, listed as the diff lists
 * its changes: at 10 % changed, a loop per byte over its bits took 220 ms for 0.5 GiB. */
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define WORDS_OF(nbytes) ((nbytes) / 8)
#else
#define WORDS_OF(nbytes) 0
#endif

/* A bitmap record's set bit for element i (in bitmap_E): past n, the record is refused;
 * the first k take their values. */
#define PATCH_BIT(E, i)                                                                         \
    do {                                                                                        \
        const int64_t i_ = (i);                                                                 \
        if (i_ >= n) return -1;                                                                 \
        if (j < k) {                                                                            \
            sum += weight(start + i_) * (load(vals + j * (E), E) - load(dst + i_ * (E), E));    \
            memcpy(dst + i_ * (E), vals + j * (E), E);                                          \
        }                                                                                       \
        j++;                                                                                    \
    } while (0)

/* A whole range's digest, sum(w(start + i) * x[i]) (the running check of a destination).
 * Narrow elements (e <= 2, |x| < 2^16) in chunks of 128 at base b: the chunk's share is
 * w(b) * S1 + 2654435761 * S2 with S1 = sum x[k], S2 = sum k * x[k] (k < 128): both fit
 * 32-bit lanes, so the loop vectorizes (AVX2 where the CPU has it), ~4x the 64-bit
 * multiply per element, which ran at a third of memory speed. */
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) /* (ifunc: Linux/glibc) */
__attribute__((target_clones("avx2", "default")))
#endif
static uint64_t digest_narrow(const uint8_t *dst, int64_t n, int64_t start, int e) {
    uint64_t sum = 0;
    int64_t b = 0;
    for (; b + 128 <= n; b += 128) {
        int32_t s1 = 0, s2 = 0;
        if (e == 2) {
            const int16_t *x = (const int16_t *)(dst + 2 * b);
            for (int32_t k = 0; k < 128; k++) { int16_t v; memcpy(&v, x + k, 2); s1 += v; s2 += k * v; }
        } else {
            const uint8_t *x = dst + b;
            for (int32_t k = 0; k < 128; k++) { s1 += x[k]; s2 += k * x[k]; }
        }
        sum += weight(start + b) * (uint64_t)(int64_t)s1 + 2654435761u * (uint64_t)(int64_t)s2;
    }
    for (; b < n; b++) sum += weight(start + b) * load(dst + b * e, e);
    return sum;
}

static uint64_t digest_wide(const uint8_t *dst, int64_t n, int64_t start, int e) {
    uint64_t sum = 0;
    for (int64_t i = 0; i < n; i++) sum += weight(start + i) * load(dst + i * e, e);
    return sum;
}

/* The receiver's writes, for E-byte elements (E a constant: each copy one move), into dst:
 * the first of n elements a record covers (start: its position in the tensor, for the
 * digest, which is read against dst before each write). sparse: k values at positions pos,
 * returns -1 or the index of the first position outside [0, n) (nothing written from there
 * on). bitmap: the values at the set bits (the first k written), returns the number of set
 * bits, or -1 where a bit lies past n. dense: n values. */
#define APPLY(E)                                                                                \
    static int64_t sparse_##E(uint8_t *dst, int64_t n, int64_t start, const int32_t *pos,      \
                              const uint8_t *vals, int64_t k, uint64_t *digest) {               \
        uint64_t sum = 0;                                                                       \
        for (int64_t j = 0; j < k; j++) {                                                       \
            int64_t i = pos[j];                                                                 \
            if (j + AHEAD < k) __builtin_prefetch(dst + (int64_t)pos[j + AHEAD] * (E), 1, 0);   \
            if (i < 0 || i >= n) { *digest = sum; return j; }                                  \
            sum += weight(start + i) * (load(vals + j * (E), E) - load(dst + i * (E), E));      \
            memcpy(dst + i * (E), vals + j * (E), E);                                           \
        }                                                                                       \
        *digest = sum;                                                                          \
        return -1;                                                                              \
    }                                                                                           \
    static int64_t bitmap_##E(uint8_t *dst, int64_t n, int64_t start, const uint8_t *bitmap,   \
                              const uint8_t *vals, int64_t k, uint64_t *digest) {               \
        uint64_t sum = 0;                                                                       \
        int64_t j = 0;                                                                          \
        const int64_t nbytes = (n + 7) / 8, words = WORDS_OF(nbytes);                           \
        int32_t at[CHUNK * 64 + 8];                                                             \
        for (int64_t w0 = 0; w0 < words; w0 += CHUNK) { /* as the diff: bits listed, then taken */ \
            const int64_t w1 = words - w0 < CHUNK ? words : w0 + CHUNK;                         \
            int t = 0;                                                                          \
            for (int64_t w = w0; w < w1; w++) {                                                 \
                uint64_t m;                                                                     \
                memcpy(&m, bitmap + 8 * w, 8); /* (little-endian: bit q of byte b is bit 8 b + q) */ \
                t += list_bits(m, (int)(64 * (w - w0)), at + t, 8); /* (a bitmap: > 1 in 32 changed) */ \
            }                                                                                   \
            for (int q = 0; q < t; q++) PATCH_BIT(E, 64 * w0 + at[q]);                          \
        }                                                                                       \
        for (int64_t byte = 8 * words; byte < nbytes; byte++)                                   \
            for (unsigned bits = bitmap[byte]; bits; bits &= bits - 1)                          \
                PATCH_BIT(E, byte * 8 + __builtin_ctz(bits));                                   \
        *digest = sum;                                                                          \
        return j;                                                                               \
    }                                                                                           \
    static void dense_##E(uint8_t *dst, int64_t n, int64_t start, const uint8_t *vals,          \
                          uint64_t *digest) {                                                   \
        uint64_t sum = 0;                                                                       \
        for (int64_t i = 0; i < n; i++)                                                         \
            sum += weight(start + i) * (load(vals + i * (E), E) - load(dst + i * (E), E));      \
        memcpy(dst, vals, (size_t)(n * (E)));                                                   \
        *digest = sum;                                                                          \
    }                                                                                           \
    static void digest_##E(const uint8_t *dst, int64_t n, int64_t start, uint64_t *digest) {    \
        *digest = (E) <= 2 ? digest_narrow(dst, n, start, E) : digest_wide(dst, n, start, E);   \
    }

APPLY(1)
APPLY(2)
APPLY(4)
APPLY(8)

/* Apply count records, one call for many. Row i of rows: kind, dst (address of the first
 * element the record covers), n, e, start, where (positions or bitmap: address), vals
 * (address), k. Row i of results: our digest (KIND_FULL: 0; KIND_DIGEST, which writes
 * nothing: sum(w(start + i) * dst[i]) over its n elements, the running check of a whole
 * destination), and the status: KIND_SPARSE,
 * -1 or the index of the first position out of range; KIND_BITMAP, the number of set bits
 * (-1: a bit past n); otherwise 0. */
void wb_apply_many(int64_t count, const int64_t *rows, int64_t *results) {
    for (int64_t r = 0; r < count; r++) {
        const int64_t *row = rows + 8 * r;
        uint8_t *dst = (uint8_t *)(intptr_t)row[1];
        const uint8_t *where = (const uint8_t *)(intptr_t)row[5], *vals = (const uint8_t *)(intptr_t)row[6];
        const int64_t kind = row[0], n = row[2], start = row[4], k = row[7];
        uint64_t sum = 0;
        int64_t status = 0;
        if (kind == KIND_FULL) {
            memcpy(dst, vals, (size_t)(n * row[3]));
        } else {
#define CALL(E)                                                                                   \
    if (kind == KIND_DENSE) dense_##E(dst, n, start, vals, &sum);                                 \
    else if (kind == KIND_DIGEST) digest_##E(dst, n, start, &sum);                                \
    else if (kind == KIND_SPARSE) status = sparse_##E(dst, n, start, (const int32_t *)where, vals, k, &sum); \
    else status = bitmap_##E(dst, n, start, where, vals, k, &sum)
            BY_WIDTH(row[3], CALL)
#undef CALL
        }
        results[2 * r] = (int64_t)sum;
        results[2 * r + 1] = status;
    }
}
