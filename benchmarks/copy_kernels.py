"""Which way of copying many tensors into their destinations wins on a GPU (issue 11:
"multi-tensor copy/cast, or one kernel over an offset table: measure which wins").

One process, one GPU, the tensors of a preset (default: Qwen3-30B-A3B, 24 layers, 9,435
tensors), sources in the trainer's dtype, destinations bf16, each variant checked bitwise
against the floor's result:

    floor        one bulk cast-copy of the same number of elements (per 2^28)
    per-tensor   dst.copy_(src) per tensor
    foreach/1G   torch._foreach_copy_ per 1 GiB group
    copylist     weightbus's CopyList (foreach for small tensors, copy_ for >= 16 MiB)
    triton       one Triton kernel over an offset table (src, dst, numel per tensor,
                 a block table made once), with and without 16-byte alignment hints

    python benchmarks/copy_kernels.py [--preset 30b-a3b --layers 24 --dtype bf16|fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from weightbus.packing.buffers import CopyList
from weightbus.planning import presets
from weightbus.tools.bench import BenchConfig, _bulk_cast_copy


def timed(fn, iters: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_table(src_ptrs, dst_ptrs, numels, blk_tensor, blk_start, src_like, dst_like,
                       BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
            pid = tl.program_id(0)
            t = tl.load(blk_tensor + pid)
            start = tl.load(blk_start + pid)
            n = tl.load(numels + t)
            s = tl.load(src_ptrs + t)
            d = tl.load(dst_ptrs + t)
            if ALIGNED:
                s = tl.multiple_of(s, 16)
                d = tl.multiple_of(d, 16)
            src = s.to(src_like.dtype)  # the address as a pointer of the source's type
            dst = d.to(dst_like.dtype)
            offs = start + tl.arange(0, BLOCK)
            if ALIGNED:
                offs = tl.max_contiguous(tl.multiple_of(offs, BLOCK), BLOCK)
            mask = offs < n
            x = tl.load(src + offs, mask=mask)
            tl.store(dst + offs, x.to(dst_like.dtype.element_ty), mask=mask)

        _KERNEL = copy_table
    return _KERNEL


def triton_copier(srcs: list[torch.Tensor], dsts: list[torch.Tensor], block: int, hints: bool):
    kernel = _kernel()
    dev = dsts[0].device
    numels = [t.numel() for t in dsts]
    blocks = [(i, s) for i, n in enumerate(numels) for s in range(0, n, block)]
    blk_tensor = torch.tensor([b[0] for b in blocks], dtype=torch.int32, device=dev)
    blk_start = torch.tensor([b[1] for b in blocks], dtype=torch.int64, device=dev)
    n_t = torch.tensor(numels, dtype=torch.int64, device=dev)
    d_ptrs = torch.tensor([t.data_ptr() for t in dsts], dtype=torch.int64, device=dev)
    aligned = all(t.data_ptr() % 16 == 0 for t in [*srcs, *dsts])

    def run() -> None:
        s_ptrs = torch.tensor([t.data_ptr() for t in srcs], dtype=torch.int64).to(dev, non_blocking=True)
        kernel[(len(blocks),)](s_ptrs, d_ptrs, n_t, blk_tensor, blk_start, srcs[0], dsts[0],
                               BLOCK=block, ALIGNED=hints and aligned, num_warps=4)
    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="30b-a3b")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    src_dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    shapes = [s for _, s in presets.shapes(a.preset, a.layers)]
    g = torch.Generator(device=dev).manual_seed(0)
    srcs = [torch.randn(s, device=dev, generator=g).to(src_dtype) for s in shapes]
    dsts = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes]
    gb = sum(t.numel() for t in srcs) * 2 / 1e9
    floor = _bulk_cast_copy(BenchConfig(scenario="colocated", preset=a.preset, layers=a.layers,
                                        trainer_dtype=a.dtype, gpu=True), dev)  # the bench's floor

    want = [s.to(torch.bfloat16) for s in srcs]
    groups, cur, size = [], [], 0
    for i, t in enumerate(dsts):
        cur.append(i)
        size += t.numel() * 2
        if size >= 1 << 30:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    copylist = CopyList(dsts)
    variants = {
        "floor": floor,
        "per-tensor": lambda: [d.copy_(s) for d, s in zip(dsts, srcs, strict=True)],
        "foreach/1G": lambda: [torch._foreach_copy_([dsts[i] for i in grp], [srcs[i] for i in grp])
                               for grp in groups],
        "copylist": lambda: copylist.run(srcs),
    }
    for block, hints in ((4096, False), (8192, True), (16384, True)):
        try:
            variants[f"triton/{block}{'/aligned' if hints else ''}"] = triton_copier(srcs, dsts, block, hints)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"triton/{block}: cannot build: {type(e).__name__}: {e}")
    base = None
    print(f"{a.preset} {a.layers} layers, {len(srcs)} tensors, {gb:.2f} GB bf16, {a.dtype} sources")
    print(f"{'variant':<22} {'ms':>8} {'GB/s':>8} {'x floor':>8}  check")
    for name, fn in variants.items():
        for d in dsts:
            d.zero_()
        try:
            t = timed(fn)
        except Exception as e:  # noqa: BLE001
            print(f"{name:<22} FAILED: {type(e).__name__}: {str(e)[:300]}")
            continue
        ok = name == "floor" or all(torch.equal(d, w) for d, w in zip(dsts, want, strict=True))
        base = base or t
        print(f"{name:<22} {t * 1e3:8.2f} {gb / t:8.1f} {t / base:7.2f}x  {'OK' if ok else 'MISMATCH'}",
              flush=True)


if __name__ == "__main__":
    main()
