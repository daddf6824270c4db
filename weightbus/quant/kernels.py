"""The block-fp8 quantizer as one Triton kernel over many tensors (launched by
:func:`weightbus.quant.quantize_many`, which says when). Imported only where a CUDA
trainer quantizes: Triton is slow to import.

One program per 128x128 block of any tensor of the group: a table gives each block its
tensor and its index, and each tensor its addresses and shape, so a group's blocks go in
one launch (up to four: tensors whose rows are 16-byte aligned get wide accesses, and the
blocks wholly inside their tensor go unmasked). A launch per
tensor, with the 4-6 torch ops of the plain path each, is what made the plain path 80x a
bulk cast on 9,312 tensors. The arithmetic is torch's on a GPU, operation for operation,
so the bits are those of vLLM's quantizer run there (the tests compare them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_SRC = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _block_fp8(src_tab, dst_tab, scale_tab, rows_tab, cols_tab, blk_tensor, blk_index,
               SRC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, INV_MAX: tl.constexpr,
               ALIGN: tl.constexpr, FULL: tl.constexpr, SUB: tl.constexpr):
    b = tl.program_id(0)
    t = tl.load(blk_tensor + b)
    i = tl.load(blk_index + b)
    m = tl.load(rows_tab + t)
    n = tl.load(cols_tab + t)
    nbc = (n + BN - 1) // BN
    r0 = (i // nbc) * BM
    c0 = (i % nbc) * BN
    corner = r0.to(tl.int64) * n + c0  # (64-bit once per block; 32-bit offsets inside it)
    src = tl.load(src_tab + t).to(tl.pointer_type(SRC)) + corner
    dst = tl.load(dst_tab + t).to(tl.pointer_type(tl.float8e4nv)) + corner
    scale = tl.load(scale_tab + t).to(tl.pointer_type(tl.float32))
    stride = n.to(tl.int32)
    if ALIGN:  # (rows start 16-byte aligned in both: 16-byte accesses, not 2-byte ones)
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        stride = tl.multiple_of(stride, 16)
    c = tl.arange(0, BN)[None, :]
    # two passes over the block, SUB rows at a time: its amax, then its values (read again
    # from L2, where the first pass asked them to stay); holding the whole block in
    # registers was slower. A FULL block (all of it inside its tensor: every block of the
    # usual shapes) goes unmasked: a mask the compiler cannot prove uniform splits each
    # access into 2-byte ones, which cost 1.6x on an H200.
    amax = tl.zeros((SUB, BN), dtype=tl.float32)
    for s in tl.range(0, BM, SUB):
        r = s + tl.arange(0, SUB)[:, None]
        if FULL:
            x = tl.load(src + r * stride + c, eviction_policy="evict_last")
        else:
            x = tl.load(src + r * stride + c, mask=(r < m - r0) & (c < n - c0), other=0.0,
                        eviction_policy="evict_last")
        # (a NaN kept, as torch's amax keeps it: a max that drops it would quantize a NaN
        # weight with a finite scale, and the update would not see it)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)), propagate_nan=tl.PropagateNan.ALL)
    # amax in float32, clamped at 1e-4; sf = amax / 448 as torch computes it on a GPU
    # (a tensor divided by a scalar is multiplied by the scalar's float32 reciprocal);
    # 1 / sf an IEEE division (torch's reciprocal); values * (1 / sf) cast to e4m3 (round
    # to nearest even; in range here, so saturating or not gives the same bits). A block
    # with a NaN gets a NaN scale (the reduction below drops NaNs: they are looked for).
    sf = tl.maximum(tl.max(tl.max(amax, axis=1), axis=0), 1e-4) * INV_MAX
    nans = tl.sum(tl.sum((amax != amax).to(tl.int32), axis=1), axis=0)
    sf = tl.where(nans > 0, float("nan"), sf)
    inv = tl.math.div_rn(1.0, sf)
    for s in tl.range(0, BM, SUB):
        r = s + tl.arange(0, SUB)[:, None]
        if FULL:
            x = tl.load(src + r * stride + c, eviction_policy="evict_first")
            tl.store(dst + r * stride + c, (x.to(tl.float32) * inv).to(tl.float8e4nv))
        else:
            inside = (r < m - r0) & (c < n - c0)
            x = tl.load(src + r * stride + c, mask=inside, other=0.0, eviction_policy="evict_first")
            tl.store(dst + r * stride + c, (x.to(tl.float32) * inv).to(tl.float8e4nv), mask=inside)
    tl.store(scale + i, sf)


class BlockLaunch:
    """One launch over a fixed list of CUDA matrices: the fp8 payloads and the scales are
    views of two flat buffers, and the tables live on the device, so a source that sends
    the same tensors at every update (a model's parameters do not move) pays the set-up
    once and then one launch per group. With ``outs`` (contiguous e4m3 tensors of the
    sources' shapes: a colocated rollout's own weights) the payloads are written there
    instead, and no payload buffer is made."""

    def __init__(self, srcs: list[torch.Tensor], scale_shapes: list[tuple[int, ...]],
                 block: tuple[int, int], fp8_max: float, outs: list[torch.Tensor] | None = None):
        device = srcs[0].device
        self.block, self.dtype = block, srcs[0].dtype
        # (1 / 448 rounded to float32, as torch rounds it before multiplying)
        self.inv_max = float(torch.tensor(1.0) / torch.tensor(fp8_max, dtype=torch.float32))
        bm, bn = block
        rows = [t.shape[0] for t in srcs]
        cols = [t.shape[1] for t in srcs]
        numel = [m * n for m, n in zip(rows, cols, strict=True)]
        counts = [-(-m // bm) * -(-n // bn) for m, n in zip(rows, cols, strict=True)]
        if outs is None:
            starts = [0]  # (each payload 16-byte aligned in one flat buffer)
            for k in numel:
                starts.append(starts[-1] + -(-k // 16) * 16)
            self.payload: torch.Tensor | None = torch.empty(starts[-1], dtype=torch.float8_e4m3fn,
                                                            device=device)
            outs = [self.payload[a:a + k].view(t.shape) for a, k, t in zip(starts, numel, srcs, strict=False)]
        else:
            self.payload = None
        self.outs = outs
        self.scale_flat = torch.empty(sum(counts), dtype=torch.float32, device=device)
        self.scales = [sc.view(shape) for sc, shape in
                       zip(self.scale_flat.split(counts), scale_shapes, strict=True)]
        host = torch.tensor([[t.data_ptr() for t in srcs], [q.data_ptr() for q in self.outs],
                             [sc.data_ptr() for sc in self.scales], rows, cols], dtype=torch.int64)
        self.tab = host.to(device)
        aligned = torch.tensor([t.data_ptr() % 16 == 0 and q.data_ptr() % 16 == 0 and n % 16 == 0
                                for t, q, n in zip(srcs, outs, cols, strict=True)], device=device)
        tensor, index = _blocks(counts, device)
        # (a block is full when its row block and its column block are: those below the
        # last, or the last where the extent divides by the block)
        cols_d = torch.tensor(cols, dtype=torch.int32, device=device)[tensor]
        rows_d = torch.tensor(rows, dtype=torch.int32, device=device)[tensor]
        nbc = (cols_d + bn - 1) // bn
        full = ((index // nbc + 1) * bm <= rows_d) & ((index % nbc + 1) * bn <= cols_d)
        self.launches = []
        for align in (True, False):
            for whole in (True, False):
                pick = (aligned[tensor] == align) & (full == whole)
                self.launches.append((align, whole, int(pick.sum()), tensor[pick], index[pick]))

    # (an H200, 30b-a3b's 9,312 served weights, full blocks: 8 rows of a block at a time
    # in 8 warps, 11.0 ms, 4,080 GB/s; 8/4 13.7 ms, 16/4 13.5 ms, 16/8 11.4 ms with the
    # eviction hints 14.6 ms without; a bulk cast 13.5 ms. benchmarks/quant_kernels.py)
    num_warps, sub = 8, 8

    def run(self) -> None:
        t = self.tab
        for align, full, total, blk_tensor, blk_index in self.launches:
            if total:
                _block_fp8[(total,)](t[0], t[1], t[2], t[3], t[4], blk_tensor, blk_index,
                                     SRC=_SRC[self.dtype], BM=self.block[0], BN=self.block[1],
                                     INV_MAX=self.inv_max, ALIGN=align, FULL=full, SUB=self.sub,
                                     num_warps=self.num_warps)


def _blocks(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(each block's tensor, its index in that tensor) for every block of every tensor."""
    per = torch.tensor(counts, dtype=torch.int64, device=device)
    total = int(sum(counts))
    tensor = torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int32, device=device), per,
                                     output_size=total)
    starts = torch.cumsum(per, 0) - per
    index = (torch.arange(total, device=device, dtype=torch.int64)
             - torch.repeat_interleave(starts, per, output_size=total)).to(torch.int32)
    return tensor, index
