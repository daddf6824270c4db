"""Many tensor copies on one GPU as one Triton launch over a chunk table (used by
:class:`weightbus.packing.buffers.CopyList`, which says when). Imported only where a list of CUDA
tensors is copied: Triton is slow to import.

Each row of the table is a chunk of one pair: its source address, its destination
address, its length in elements (at most :data:`CHUNK_BYTES` of the wider side). One program
copies one chunk, so a bucket of thousands of tensors is one launch (two where some pairs are
not 16-byte aligned: the aligned launch gets 16-byte accesses, the rest element-wise ones), whatever
the count. ``torch._foreach_copy_`` pays a few microseconds of host work a tensor and
launches a kernel per few dozen of them: on 30b-a3b's 9,435 tensors that was 1.6x of one
bulk copy of the same bytes, this ~1.05x (an H200).

The table is built once per list of sources and reused while they are the very tensors at
the very addresses tabled (a C-level pass over their pointers at each call). Pairs of one
dtype are copied as integers of its width (the bits, NaNs included). One cast is done here
too, float32 -> bfloat16 (a float32 trainer's weights onto a bfloat16 wire), by its bits:
rounding to nearest even as torch does, a NaN stays a NaN (:func:`_round_bf16`); torch's
multi-tensor cast ran at ~1.5x of one bulk cast on 30b-a3b. Other casts are left to torch.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from weightbus.packing.buffers import TabledCopy

#: Bytes per chunk (a program's share).
CHUNK_BYTES = 64 << 10
_BLOCK = 4096  # elements a program moves per step of its loop
# 16 warps: one 16-byte access per thread per step for 2-byte elements; on an H200, 30b-a3b's
# 9,435 tensors copied at 1.05x of one bulk copy against 1.12x with 4 (benchmarks/copy_sweep.py)
_WARPS = 16

_BITS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
#: The casts tabled here (source, destination dtype), done on the bits: no other cast would
#: come out as torch's bit for bit under Triton's interpreter too (it truncates).
_CASTS = {(torch.float32, torch.bfloat16)}


@triton.jit
def _round_bf16(bits):
    """float32 bit patterns (int32) -> bfloat16 ones (int16), as torch rounds: to nearest,
    ties to even; infinities stay, a NaN stays a quiet NaN of its sign."""
    u = bits.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where((u & 0x7FFFFFFF) > 0x7F800000, ((u >> 16) & 0x8000) | 0x7FC0, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _copy_chunks(src_tab, dst_tab, len_tab, S: tl.constexpr, D: tl.constexpr, VEC: tl.constexpr,
                 BLOCK: tl.constexpr, CAST: tl.constexpr):
    c = tl.program_id(0)
    src = tl.load(src_tab + c).to(tl.pointer_type(S))
    dst = tl.load(dst_tab + c).to(tl.pointer_type(D))
    n = tl.load(len_tab + c).to(tl.int32)
    if VEC > 1:  # (both 16-byte aligned, a multiple of 16 bytes of the narrower side: wide accesses)
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        n = tl.multiple_of(n, VEC)
    for s in tl.range(0, n, BLOCK):
        o = tl.multiple_of(s, BLOCK) + tl.arange(0, BLOCK)
        inside = o < n
        x = tl.load(src + o, mask=inside, eviction_policy="evict_first")
        if CAST:
            x = _round_bf16(x)
        tl.store(dst + o, x, mask=inside)


class DeviceCopy(TabledCopy):
    """``dst.copy_(src)`` for a fixed list of destinations on one GPU, from sources given
    per call, in one or a few launches."""

    def __init__(self, dsts: list[torch.Tensor]):
        super().__init__(dsts)
        self._device = dsts[0].device
        self._numel = np.array([d.numel() for d in dsts], np.int64)
        self._launches: list[tuple[tuple[int, int], int, torch.Tensor, int]] = []
        self._casts: set[torch.dtype] = set()  # source dtypes refused for a cast: not looked at again

    @staticmethod
    def usable(dsts: list[torch.Tensor]) -> bool:
        if not dsts:
            return False
        device = dsts[0].device
        return device.type == "cuda" and all(d.device == device and d.is_contiguous() for d in dsts)

    def table(self, srcs: list[torch.Tensor]) -> bool:
        """As :meth:`TabledCopy.table`: sources fit on this GPU, contiguous, of the same shape
        and dtype as their destinations (or float32 onto bfloat16 ones)."""
        if not srcs or srcs[0].dtype in self._casts:  # (a cast list: torch's, at no cost here)
            return False
        return super().table(srcs)

    def _fit(self, srcs: list[torch.Tensor], src: np.ndarray) -> bool:
        groups: dict[tuple[int, int], list[int]] = {}  # (by widths: one launch of their integer types)
        for i, (s, d) in enumerate(zip(srcs, self._dsts, strict=True)):
            if s.dtype != d.dtype and (s.dtype, d.dtype) not in _CASTS:
                if i == 0:
                    self._casts.add(s.dtype)
                return False
            if s.device != self._device or not s.is_contiguous() or s.shape != d.shape \
                    or s.element_size() not in _BITS:
                return False
            groups.setdefault((s.element_size(), d.element_size()), []).append(i)
        self._launches = [launch for widths, idx in groups.items()
                          for launch in _launches(np.array(idx, np.int64), src, self._dst, self._numel,
                                                  widths, self._device)]
        return True

    def copy(self) -> None:
        """Copy from the sources last tabled (on the current stream)."""
        if self._device.type != "cuda":  # (Triton's interpreter, in the tests)
            return self._launch()
        with torch.cuda.device(self._device):  # (Triton launches on the current device's stream)
            self._launch()

    def _launch(self) -> None:
        for (sw, dw), vec, tab, n in self._launches:
            _copy_chunks[(n,)](tab[0], tab[1], tab[2], S=_BITS[sw], D=_BITS[dw], VEC=vec, BLOCK=_BLOCK,
                               CAST=sw != dw, num_warps=_WARPS)


def _launches(idx: np.ndarray, src: np.ndarray, dst: np.ndarray, numel: np.ndarray, widths: tuple[int, int],
              device: torch.device) -> list[tuple[tuple[int, int], int, torch.Tensor, int]]:
    """The chunk tables of the pairs ``idx`` (elements of ``widths`` bytes, source and
    destination): an aligned launch for the whole 16-byte units (of the narrower side) of pairs
    whose two addresses are 16-byte aligned, an element-wise one for the rest (the tails of
    those, and every unaligned pair)."""
    sw, dw = widths
    s, d, n = src[idx], dst[idx], numel[idx]
    vec = max(1, 16 // min(sw, dw))  # (elements of 16 bytes)
    aligned = (s % 16 == 0) & (d % 16 == 0)
    main = np.where(aligned, n - n % vec, 0)
    out = []
    for v, ss, dd, nn in ((vec, s, d, main), (1, s + main * sw, d + main * dw, n - main)):
        keep = nn > 0
        ss, dd, nn = ss[keep], dd[keep], nn[keep]
        if not len(nn):
            continue
        chunk = CHUNK_BYTES // max(sw, dw)  # (elements)
        per = -(-nn // chunk)  # chunks of each pair
        k = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per)
        off = k * chunk  # (each chunk's element offset in its pair)
        tab = np.stack([np.repeat(ss, per) + off * sw, np.repeat(dd, per) + off * dw,
                        np.minimum(np.repeat(nn, per) - off, chunk)])
        out.append((widths, v, torch.from_numpy(tab).to(device), tab.shape[1]))
    return out
