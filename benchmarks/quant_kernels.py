"""Which shape of the block-fp8 Triton kernel wins on a GPU (issue 35's 70%-of-HBM target).

One process, one GPU, the served weights of a preset (default: Qwen3-30B-A3B, 24 layers,
9,312 matrices, bf16), quantized to 128x128 block e4m3 over the tables of
``quant_triton.BlockLaunch``. Each variant is timed with CUDA events (kernel only, best of
``--iters``) and checked bitwise against the landed kernel's payloads and scales:

    landed       quant_triton._block_fp8: two passes, SUB rows at a time, loops not unrolled,
                 full blocks unmasked (and the loads' eviction hints)
    looped       the landed shape with or without masks on full blocks, eviction hints or not
    unrolled     the same two passes with the row loops unrolled (all loads of a pass in
                 flight at once)
    registers    one pass: the whole block loaded once, amax and values from registers
    persistent   ``unrolled``'s body in a grid of a few programs per SM, each looping over
                 blocks

The floor is one bulk bf16 -> e4m3 cast of the same bytes; GB/s count bf16 read + fp8
written + scales.

    python benchmarks/quant_kernels.py [--preset 30b-a3b --layers 24 --iters 5]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from weightbus.planning import presets
from weightbus.planning.simulate import served_fp8 as served
from weightbus.quant import FP8_MAX, Fp8Format
from weightbus.quant.kernels import _SRC, BlockLaunch, _block_fp8


@triton.jit
def _ld(ptr, mask, EVEN: tl.constexpr, EVICT: tl.constexpr):
    if EVEN:
        x = tl.load(ptr, eviction_policy=EVICT)
    else:
        x = tl.load(ptr, mask=mask, other=0.0, eviction_policy=EVICT)
    return x.to(tl.float32)


@triton.jit
def _st(ptr, val, mask, EVEN: tl.constexpr):
    if EVEN:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=mask)


@triton.jit
def _block_body(b, src_tab, dst_tab, scale_tab, rows_tab, cols_tab, blk_tensor, blk_index,
                SRC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, INV_MAX: tl.constexpr,
                ALIGN: tl.constexpr, SUB: tl.constexpr, ONE_PASS: tl.constexpr,
                UNROLL: tl.constexpr, EVEN: tl.constexpr, EVICT1: tl.constexpr, EVICT2: tl.constexpr):
    t = tl.load(blk_tensor + b)
    i = tl.load(blk_index + b)
    m = tl.load(rows_tab + t)
    n = tl.load(cols_tab + t)
    nbc = (n + BN - 1) // BN
    r0 = (i // nbc) * BM
    c0 = (i % nbc) * BN
    corner = r0.to(tl.int64) * n + c0
    src = tl.load(src_tab + t).to(tl.pointer_type(SRC)) + corner
    dst = tl.load(dst_tab + t).to(tl.pointer_type(tl.float8e4nv)) + corner
    scale = tl.load(scale_tab + t).to(tl.pointer_type(tl.float32))
    stride = n.to(tl.int32)
    if ALIGN:
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        stride = tl.multiple_of(stride, 16)
    if ONE_PASS:
        r = tl.arange(0, BM)[:, None]
        c = tl.arange(0, BN)[None, :]
        if EVEN:
            x = tl.load(src + r * stride + c).to(tl.float32)
        else:
            x = tl.load(src + r * stride + c, mask=(r < m - r0) & (c < n - c0), other=0.0).to(tl.float32)
        sf = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-4) * INV_MAX
        inv = tl.math.div_rn(1.0, sf)
        if EVEN:
            tl.store(dst + r * stride + c, (x * inv).to(tl.float8e4nv))
        else:
            tl.store(dst + r * stride + c, (x * inv).to(tl.float8e4nv), mask=(r < m - r0) & (c < n - c0))
    elif UNROLL:
        c = tl.arange(0, BN)[None, :]
        amax = tl.zeros((SUB, BN), dtype=tl.float32)
        for s in tl.static_range(0, BM, SUB):
            r = s + tl.arange(0, SUB)[:, None]
            x = _ld(src + r * stride + c, (r < m - r0) & (c < n - c0), EVEN, EVICT1)
            amax = tl.maximum(amax, tl.abs(x))
        sf = tl.maximum(tl.max(tl.max(amax, axis=1), axis=0), 1e-4) * INV_MAX
        inv = tl.math.div_rn(1.0, sf)
        for s in tl.static_range(0, BM, SUB):
            r = s + tl.arange(0, SUB)[:, None]
            inside = (r < m - r0) & (c < n - c0)
            x = _ld(src + r * stride + c, inside, EVEN, EVICT2)
            _st(dst + r * stride + c, (x * inv).to(tl.float8e4nv), inside, EVEN)
    else:
        c = tl.arange(0, BN)[None, :]
        amax = tl.zeros((SUB, BN), dtype=tl.float32)
        for s in tl.range(0, BM, SUB):
            r = s + tl.arange(0, SUB)[:, None]
            x = _ld(src + r * stride + c, (r < m - r0) & (c < n - c0), EVEN, EVICT1)
            amax = tl.maximum(amax, tl.abs(x))
        sf = tl.maximum(tl.max(tl.max(amax, axis=1), axis=0), 1e-4) * INV_MAX
        inv = tl.math.div_rn(1.0, sf)
        for s in tl.range(0, BM, SUB):
            r = s + tl.arange(0, SUB)[:, None]
            inside = (r < m - r0) & (c < n - c0)
            x = _ld(src + r * stride + c, inside, EVEN, EVICT2)
            _st(dst + r * stride + c, (x * inv).to(tl.float8e4nv), inside, EVEN)
    tl.store(scale + i, sf)


@triton.jit
def _unrolled(src_tab, dst_tab, scale_tab, rows_tab, cols_tab, blk_tensor, blk_index,
              SRC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, INV_MAX: tl.constexpr,
              ALIGN: tl.constexpr, SUB: tl.constexpr, ONE_PASS: tl.constexpr,
                UNROLL: tl.constexpr, EVEN: tl.constexpr, EVICT1: tl.constexpr, EVICT2: tl.constexpr):
    _block_body(tl.program_id(0), src_tab, dst_tab, scale_tab, rows_tab, cols_tab, blk_tensor,
                blk_index, SRC, BM, BN, INV_MAX, ALIGN, SUB, ONE_PASS, UNROLL, EVEN, EVICT1, EVICT2)


@triton.jit
def _persistent(src_tab, dst_tab, scale_tab, rows_tab, cols_tab, blk_tensor, blk_index, total,
                SRC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, INV_MAX: tl.constexpr,
                ALIGN: tl.constexpr, SUB: tl.constexpr, ONE_PASS: tl.constexpr,
                UNROLL: tl.constexpr, EVEN: tl.constexpr, EVICT1: tl.constexpr, EVICT2: tl.constexpr):
    for b in tl.range(tl.program_id(0), total, tl.num_programs(0)):
        _block_body(b, src_tab, dst_tab, scale_tab, rows_tab, cols_tab, blk_tensor,
                    blk_index, SRC, BM, BN, INV_MAX, ALIGN, SUB, ONE_PASS, UNROLL, EVEN, EVICT1, EVICT2)



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="30b-a3b")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    dev = torch.device("cuda")
    shapes = [s for n, s in presets.shapes(a.preset, a.layers) if served(n, s)]
    numel = [s[0] * s[1] for s in shapes]
    flat = torch.randn(sum(numel), device=dev, dtype=torch.bfloat16)
    srcs = [w.view(s) for w, s in zip(flat.split(numel), shapes, strict=True)]
    fmt = Fp8Format("block")
    launch = BlockLaunch(srcs, [fmt.scale_shape(tuple(s)) for s in shapes], fmt.block, FP8_MAX)
    cast = torch.empty(flat.shape, dtype=torch.float8_e4m3fn, device=dev)
    moved = flat.numel() * 3 + launch.scale_flat.numel() * 4
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(f"device: {torch.cuda.get_device_name(dev)}, {sms} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}; {a.preset} x{a.layers}: {len(shapes)} matrices, "
          f"{flat.numel() * 2 / 1e9:.1f} GB bf16")

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(a.iters):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            torch.cuda.synchronize()
            best = min(best, e0.elapsed_time(e1) / 1e3)
        return best

    def kernel(kern, sub: int, warps: int, one_pass: bool = False, per_sm: int = 0,
               unroll: bool = False, masked: bool = False, evict: tuple[str, str] = ("", "")):
        tab = launch.tab

        def go() -> None:
            for align, full, total, bt, bi in launch.launches:
                if not total:
                    continue
                kw = dict(SRC=_SRC[launch.dtype], BM=128, BN=128, INV_MAX=launch.inv_max,
                          ALIGN=align, SUB=sub, num_warps=warps)
                if kern is _block_fp8:
                    kern[(total,)](tab[0], tab[1], tab[2], tab[3], tab[4], bt, bi, FULL=full, **kw)
                    continue
                kw.update(ONE_PASS=one_pass, UNROLL=unroll, EVEN=full and not masked,
                          EVICT1=evict[0], EVICT2=evict[1])
                if kern is _unrolled:
                    kern[(total,)](tab[0], tab[1], tab[2], tab[3], tab[4], bt, bi, **kw)
                else:
                    kern[(min(total, sms * per_sm),)](tab[0], tab[1], tab[2], tab[3], tab[4], bt, bi,
                                                     total, **kw)
        return go

    floor = timed(lambda: cast.copy_(flat))
    launch.run()
    torch.cuda.synchronize()
    want_q, want_s = launch.payload.view(torch.uint8).clone(), launch.scale_flat.clone()
    variants = [("landed 8/8w", kernel(_block_fp8, 8, 8)),
                ("looped masked 8/8w", kernel(_unrolled, 8, 8, masked=True))]
    for sub, w in [(8, 4), (8, 8), (16, 4), (16, 8), (32, 8)]:
        variants.append((f"looped even {sub}/{w}w", kernel(_unrolled, sub, w)))
    for sub, w in [(8, 8), (16, 8), (32, 8)]:
        variants.append((f"unrolled even {sub}/{w}w", kernel(_unrolled, sub, w, unroll=True)))
    for sub, w in [(8, 8), (16, 8)]:
        variants.append((f"looped even evict {sub}/{w}w",
                         kernel(_unrolled, sub, w, evict=("evict_last", "evict_first"))))
    for w in [4, 8, 16]:
        variants.append((f"registers even {w}w", kernel(_unrolled, 128, w, one_pass=True)))
    for sub, w, k in [(8, 8, 4), (16, 8, 4), (16, 8, 8)]:
        variants.append((f"persistent even {sub}/{w}w x{k}", kernel(_persistent, sub, w, per_sm=k)))
    variants.append(("persistent regs even 8w x4", kernel(_persistent, 128, 8, one_pass=True, per_sm=4)))
    print("blocks full / edge: " + " / ".join(str(sum(x[2] for x in launch.launches if x[1] == f))
                                              for f in (True, False)))
    print(f"{'variant':<28} {'ms':>7} {'/floor':>7} {'GB/s':>7} bitwise")
    print(f"{'floor (bulk cast)':<28} {floor * 1e3:>7.2f} {1:>6.2f}x {moved / floor / 1e9:>7.0f}")
    for name, fn in variants:
        launch.payload.zero_()
        launch.scale_flat.zero_()
        try:
            s = timed(fn)
        except Exception as e:  # (a shape the compiler refuses: say so, go on)
            print(f"{name:<28} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        same = torch.equal(launch.payload.view(torch.uint8), want_q) and \
            torch.equal(launch.scale_flat.view(torch.int32), want_s.view(torch.int32))
        print(f"{name:<28} {s * 1e3:>7.2f} {s / floor:>6.2f}x {moved / s / 1e9:>7.0f} {same}", flush=True)


if __name__ == "__main__":
    main()
