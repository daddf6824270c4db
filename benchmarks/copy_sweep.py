"""The GPU copy list's kernel shape against one bulk copy (issue 52: cd30's copy is 1.19x of
the bulk copy on an H200, 1.07x on an H100): each chunk size, step and warp count of
:class:`weightbus.packing.copy_triton.DeviceCopy` over a preset's tensors, bitwise-checked,
the median of ``--iters`` timed runs each, and its ratio to the bench's floor (one bulk copy
of the same bytes, as ``weightbus bench --scenario colocated-direct`` measures it).

    python benchmarks/copy_sweep.py --preset 30b-a3b --layers 24      (a GPU)
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
    a = ap.parse_args()
    dev = torch.device("cuda", 0)
    shapes = [s for _, s in presets.shapes(a.preset, a.layers)]
    g = torch.Generator(device=dev).manual_seed(0)
    srcs = [torch.randn(s, device=dev, generator=g).to(torch.bfloat16) for s in shapes]
    dsts = [torch.empty(s, dtype=torch.bfloat16, device=dev) for s in shapes]
    floor = timed(_bulk_cast_copy(BenchConfig(scenario="colocated-direct", preset=a.preset, layers=a.layers,
                                              trainer_dtype="bf16", gpu=True), dev), a.iters) * 1e3
    gb = sum(t.numel() for t in srcs) * 2 / 1e9
    print(f"{a.preset}/{a.layers}L: {len(srcs)} tensors, {gb:.2f} GB; floor (bulk copy) {floor:.2f} ms")
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
        ok = all(torch.equal(d.view(torch.int16), s.view(torch.int16))
                 for d, s in zip(dsts, srcs, strict=True))
        rows.append((ms, chunk, block, warps))
        check = "bitwise" if ok else "MISMATCH"
        print(f"{chunk:>9} {block:>6} {warps:>5} {ms:>8.2f} {ms / floor:>7.2f}x  {check}", flush=True)
    copy_triton.CHUNK_BYTES, copy_triton._BLOCK, copy_triton._WARPS = defaults
    ms, chunk, block, warps = min(rows)
    print(f"best: chunk {chunk} KiB, block {block}, warps {warps}: {ms:.2f} ms, {ms / floor:.2f}x the floor "
          f"(default {defaults[0] >> 10} KiB/{defaults[1]}/{defaults[2]})")


if __name__ == "__main__":
    main()
