"""The GPU copy list's kernel shape against one bulk copy (issue 52: cd30's copy is 1.19x of
the bulk copy on an H200, 1.07x on an H100): each chunk size, step and warp count of
:class:`weightbus.packing.copy_triton.DeviceCopy` over a preset's tensors, bitwise-checked,
the median of ``--iters`` timed runs each, and its ratio to the bench's floor (one bulk copy
of the same bytes, as ``weightbus bench --scenario colocated-direct`` measures it). With
``--dtype fp32`` the sources are float32 and the copy is the kernel's cast onto bfloat16,
against one bulk cast.

    python benchmarks/copy_sweep.py --preset 30b-a3b --layers 24 [--dtype fp32]     (a GPU)
"""

from __future__ import annotations

import argparse
import itertools

import torch
from copy_kernels import timed  # (benchmarks/: the median of timed runs, in seconds)

from weightbus.packing import copy_triton
from weightbus.planning import presets
from weightbus.tools.bench import BenchConfig, _bulk_cast_copy


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="30b-a3b")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--chunks", default="64,256,1024", help="KiB per chunk")
    ap.add_argument("--blocks", default="4096,8192,16384", help="elements a step")
    ap.add_argument("--warps", default="4,8,16")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="the sources' dtype")
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    shapes = [s for _, s in presets.shapes(a.preset, a.layers)]
    g = torch.Generator(device=dev).manual_seed(0)
    src_dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    srcs = [torch.randn(s, device=dev, generator=g).to(src_dtype) for s in shapes]
    dsts = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes]
    floor = timed(_bulk_cast_copy(BenchConfig(scenario="colocated-direct", preset=a.preset, layers=a.layers,
                                              trainer_dtype=a.dtype, gpu=True), dev), a.iters) * 1e3
    gb = sum(t.numel() for t in srcs) * 2 / 1e9
    what = "bulk copy" if a.dtype == "bf16" else "bulk cast from float32"
    print(f"{a.preset}/{a.layers}L: {len(srcs)} tensors, {gb:.2f} GB bf16; floor ({what}) {floor:.2f} ms")
    ms = timed(lambda: torch._foreach_copy_(dsts, srcs), a.iters) * 1e3
    print(f"torch._foreach_copy_ over the list (the baseline): {ms:.2f} ms, {ms / floor:.2f}x")
    print(f"{'chunk KiB':>9} {'block':>6} {'warps':>5} {'ms':>8} {'x floor':>8}  check")
    defaults = (copy_triton.CHUNK_BYTES, copy_triton._BLOCK, copy_triton._WARPS)
    rows = []
    grid = itertools.product(*(map(int, x.split(",")) for x in (a.chunks, a.blocks, a.warps)))
    for chunk, block, warps in grid:
        copy_triton.CHUNK_BYTES, copy_triton._BLOCK, copy_triton._WARPS = chunk << 10, block, warps
        dc = copy_triton.DeviceCopy(dsts)  # (tabled afresh: the chunk size is read when tabling)
        assert dc.table(srcs)
        for d in dsts:
            d.zero_()
        ms = timed(dc.copy, a.iters) * 1e3
        ok = all(torch.equal(d.view(torch.int16), s.to(torch.bfloat16).view(torch.int16))  # (one at a time:
                 for d, s in zip(dsts, srcs, strict=True))  # 30b-a3b from float32 fills most of an H200)
        rows.append((ms, chunk, block, warps))
        check = "bitwise" if ok else "MISMATCH"
        print(f"{chunk:>9} {block:>6} {warps:>5} {ms:>8.2f} {ms / floor:>7.2f}x  {check}", flush=True)
    copy_triton.CHUNK_BYTES, copy_triton._BLOCK, copy_triton._WARPS = defaults
    ms, chunk, block, warps = min(rows)
    print(f"best: chunk {chunk} KiB, block {block}, warps {warps}: {ms:.2f} ms, {ms / floor:.2f}x the floor "
          f"(default {defaults[0] >> 10} KiB/{defaults[1]}/{defaults[2]})")


if __name__ == "__main__":
    main()
