"""Delta mode's record format, read and written by both sides (see the package's
docstring): the record kinds and header, the bit views, the weighted digest, the sizes."""

from __future__ import annotations

import torch

FULL, SPARSE, BITMAP, DENSE = 0, 1, 2, 3  # record kinds (FULL: dense, in a full update)
DIGEST = 4  # a kernel row that reads a whole destination's digest (never on the wire)
_WORDS = 6  # record header: tensor, kind, start, n, k, digest
_HEADER = _WORDS * 8
_NEUTRAL = -(1 << 62)  # a rank with no say in a field of the agreement
_MASK = (1 << 62) - 1
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SLICE = 1 << 22  # elements per step of a weighted sum over a dense range (bounds temporaries)
# Elements diffed together on a GPU: each group costs the host ~1.2-1.5 ms (its launches, its
# wait, its layout), during which the GPU idles once it has diffed the group before (an
# H200 diffs 2^29 bf16 elements in ~1.1 ms); 2^30 took the 8b diff's host time from a median of
# 23.0 ms to 14.5 (RESULTS, "Delta, round twelve on 2 GPUs"). At most 2 GB of bf16 casts held (fp32
# trainers); the torch path's mask: 1 GB.
_GROUP = 1 << 30


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
