"""Many tensor copies on one GPU as one Triton launch over a chunk table (used by
:class:`weightbus.buffers.CopyList`, which says when). Imported only where a list of CUDA
tensors is copied: Triton is slow to import.

Each row of the table is a chunk of one pair: its source address, its destination
address, its length in elements (at most :data:`CHUNK`). One program copies one chunk, so
a bucket of thousands of tensors is one launch (two where some pairs are not 16-byte
aligned: the aligned launch gets 16-byte accesses, the rest element-wise ones), whatever
the count. ``torch._foreach_copy_`` pays a few microseconds of host work a tensor and
launches a kernel per few dozen of them: on 30b-a3b's 9,435 tensors that was 1.6x of one
bulk copy of the same bytes, this ~1.1x (issue 52's measure, an H100).

The table is built once per list of sources and reused while they are the very tensors at
the very addresses tabled (a C-level pass over their pointers at each call). A same-dtype
pair is copied as integers of its width (the bits, NaNs included); float32 to bfloat16
(a float32 trainer's usual wire) is rounded by its bits as torch rounds it (to nearest
even; a NaN stays a NaN), so the bits are torch's on any device and under Triton's
interpreter (whose own conversion truncates); a widening to float32 is exact; other
narrowing casts are left to torch.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

#: Elements per chunk (a program); 64 KiB of bf16.
CHUNK = 32768
_BLOCK = 4096  # elements a program moves per step of its loop

_FLOAT = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_BITS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
_data_ptr = torch.Tensor.data_ptr


@triton.jit
def _copy_chunks(src_tab, dst_tab, len_tab, SRC: tl.constexpr, DST: tl.constexpr,
                 VEC: tl.constexpr, BLOCK: tl.constexpr, TO_BF16: tl.constexpr):
    c = tl.program_id(0)
    src = tl.load(src_tab + c).to(tl.pointer_type(SRC))
    dst = tl.load(dst_tab + c).to(tl.pointer_type(DST))
    n = tl.load(len_tab + c).to(tl.int32)
    if VEC > 1:  # (both 16-byte aligned, a multiple of VEC elements: wide accesses)
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        n = tl.multiple_of(n, VEC)
    for s in tl.range(0, n, BLOCK):
        o = tl.multiple_of(s, BLOCK) + tl.arange(0, BLOCK)
        inside = o < n
        x = tl.load(src + o, mask=inside, eviction_policy="evict_first")
        if TO_BF16:  # (float32 -> bfloat16 by its bits: torch's rounding and NaN, bit for bit)
            b = x.to(tl.uint32, bitcast=True)
            r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
            tl.store(dst + o, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=inside)
        else:
            tl.store(dst + o, x.to(DST), mask=inside)


def _types(src: torch.dtype, dst: torch.dtype) -> tuple[Any, Any] | None:
    """The kernel's element types for a pair of dtypes (None: not one this kernel copies)."""
    if src == dst:
        return (_BITS[src.itemsize],) * 2 if src.itemsize in _BITS else None
    if dst == torch.float32 and src in _FLOAT or (src, dst) == (torch.float32, torch.bfloat16):
        return _FLOAT[src], _FLOAT[dst]
    return None  # (a narrowing cast other than float32 -> bfloat16: torch's multi-tensor copy)


class DeviceCopy:
    """``dst.copy_(src)`` for a fixed list of destinations on one GPU, from sources given
    per call, in one or a few launches (the interface of ``buffers._HostCopy``)."""

    def __init__(self, dsts: list[torch.Tensor]):
        self._dsts = dsts
        self._device = dsts[0].device
        self._dst = np.fromiter(map(_data_ptr, dsts), np.int64, len(dsts))
        self._numel = np.array([d.numel() for d in dsts], np.int64)
        self._srcs: list[torch.Tensor] | None = None
        self._src = self._dst[:0]
        self._launches: list[tuple[Any, Any, int, torch.Tensor, int]] = []

    @staticmethod
    def usable(dsts: list[torch.Tensor]) -> bool:
        if not dsts:
            return False
        device = dsts[0].device
        return device.type == "cuda" and all(d.device == device and d.is_contiguous() for d in dsts)

    def table(self, srcs: list[torch.Tensor]) -> bool:
        """Table the sources for :meth:`copy`; False (nothing tabled) unless every source
        fits its destination (this GPU, contiguous, the same shape, a dtype pair the kernel
        copies)."""
        src = np.fromiter(map(_data_ptr, srcs), np.int64, len(srcs))
        last = self._srcs
        if last is not None and np.array_equal(src, self._src) and all(map(operator.is_, srcs, last)):
            return True
        self._srcs = None
        pairs: dict[tuple[Any, Any], list[int]] = {}
        for i, (s, d) in enumerate(zip(srcs, self._dsts, strict=True)):
            types = _types(s.dtype, d.dtype)
            if types is None or s.device != self._device or not s.is_contiguous() or s.shape != d.shape:
                return False
            pairs.setdefault(types, []).append(i)
        self._launches = []
        for (st, dt), idx in pairs.items():
            narrow = min(srcs[idx[0]].element_size(), self._dsts[idx[0]].element_size())
            self._launches += _launches(np.array(idx, np.int64), src, self._dst, self._numel,
                                        narrow, st, dt, self._device)
        self._srcs, self._src = list(srcs), src
        return True

    def copy(self) -> None:
        """Copy from the sources last tabled (on the current stream)."""
        if self._device.type != "cuda":  # (Triton's interpreter, in the tests)
            return self._launch()
        with torch.cuda.device(self._device):  # (Triton launches on the current device's stream)
            self._launch()

    def _launch(self) -> None:
        for st, dt, vec, tab, n in self._launches:
            _copy_chunks[(n,)](tab[0], tab[1], tab[2], SRC=st, DST=dt, VEC=vec, BLOCK=_BLOCK,
                               TO_BF16=st == tl.float32 and dt == tl.bfloat16, num_warps=4)

    def run(self, srcs: list[torch.Tensor]) -> bool:
        """:meth:`table`, then :meth:`copy` where it succeeded."""
        if not self.table(srcs):
            return False
        self.copy()
        return True


def _launches(idx: np.ndarray, src: np.ndarray, dst: np.ndarray, numel: np.ndarray, narrow: int,
              st: Any, dt: Any, device: torch.device) -> list[tuple[Any, Any, int, torch.Tensor, int]]:
    """The chunk tables of the pairs ``idx`` (one dtype pair): an aligned launch for the
    whole 16-byte units of pairs whose two addresses are 16-byte aligned, an element-wise
    one for the rest (the tails of those, and every unaligned pair)."""
    s, d, n = src[idx], dst[idx], numel[idx]
    vec = 16 // narrow  # (elements of 16 bytes of the narrower side)
    aligned = (s % 16 == 0) & (d % 16 == 0)
    main = np.where(aligned, n - n % vec, 0)
    rest_s, rest_d, rest_n = s + main * _width(st), d + main * _width(dt), n - main
    out = []
    for v, ss, dd, nn in ((vec, s, d, main), (1, rest_s, rest_d, rest_n)):
        keep = nn > 0
        ss, dd, nn = ss[keep], dd[keep], nn[keep]
        if not len(nn):
            continue
        per = -(-nn // CHUNK)  # chunks of each pair
        first = np.repeat(np.cumsum(per) - per, per)
        k = np.arange(int(per.sum()), dtype=np.int64) - first  # each chunk's index in its pair
        off = k * CHUNK
        n_pair = np.repeat(nn, per)
        tab = np.stack([np.repeat(ss, per) + off * _width(st), np.repeat(dd, per) + off * _width(dt),
                        np.minimum(n_pair - off, CHUNK)])
        out.append((st, dt, v, torch.from_numpy(tab).to(device), tab.shape[1]))
    return out


def _width(t: Any) -> int:
    return t.primitive_bitwidth // 8
