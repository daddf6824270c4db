"""Delta mode's host kernels alone (``weightbus/engines/delta_cpu.c``), one call each on one
thread: the trainer's diff of 2^28 bf16 elements (0.5 GiB) against its snapshot, and the
receiver's patch of the same changes, at a few fractions changed, next to the floor of each:
one bulk copy of the bytes it must touch (the diff reads the weights and the snapshot; the
patch rewrites the destination).

    python benchmarks/delta_cpu_kernels.py [--elements 268435456] [--fractions 0 0.02 0.1]
"""

import argparse
import os
import time

import torch

from weightbus.engines.delta import cpu as kernels


def _median(times: list[float]) -> float:
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.02, 0.1])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args()
    os.environ.setdefault("WEIGHTBUS_DELTA_THREADS", "1")  # (the patch's calls; the diff's is one)
    torch.set_num_threads(1)  # (the floors' copies too)
    lib = kernels.library()
    if lib is None:
        raise SystemExit("the C kernels did not build (see the warning above)")
    n = args.elements
    g = torch.Generator().manual_seed(0)
    cur = torch.randn(n, generator=g).to(torch.bfloat16)
    snap = cur.clone()
    dest = cur.clone()
    bits = ((n + 7) // 8 + 7) // 8 * 8  # a bitmap's bytes, padded
    need = bits + 2 * n  # room for every element changed
    arena = kernels.Arena()
    copy_src, copy_dst = torch.empty(2 * n * 2, dtype=torch.uint8), torch.empty(2 * n * 2, dtype=torch.uint8)
    copy_dst.copy_(copy_src)
    t0 = time.perf_counter()
    copy_dst.copy_(copy_src)
    read_both = time.perf_counter() - t0  # the diff's floor: a copy of 2 x 0.5 GiB
    t0 = time.perf_counter()
    copy_dst[: 2 * n].copy_(copy_src[: 2 * n])
    one = time.perf_counter() - t0  # the patch's: a copy of the destination's bytes
    print(f"{n} bf16 elements ({2 * n / 2**30:.2f} GiB), one thread; floors: a bulk copy of "
          f"{4 * n / 2**30:.2f} GiB {1e3 * read_both:.1f} ms, of {2 * n / 2**30:.2f} GiB {1e3 * one:.1f} ms")
    print(f"{'changed':>8} {'diff ms':>9} {'x floor':>8} {'patch ms':>9} {'x floor':>8}  bitwise")
    for fraction in args.fractions:
        diffs, patches, ok = [], [], True
        for _ in range(args.rounds):
            k = int(n * fraction)
            if k:
                idx = torch.randint(0, n, (k,), generator=g)
                cur.view(torch.int16)[idx] += 1
            rows = torch.tensor([[cur.data_ptr(), snap.data_ptr(), n, 2, 0, bits // 4]], dtype=torch.int64)
            arena.reset()
            t0 = time.perf_counter()
            results, out = kernels.diff_many(lib, rows, need, arena)
            diffs.append(time.perf_counter() - t0)
            kind, count = int(results[0, 0]), int(results[0, 1])
            if kind in (1, 2):  # positions or a bitmap, then the values: patch the destination
                where = out.data_ptr() + int(results[0, 3])
                vals = where + int(results[0, 4]) - (2 * count + 7) // 8 * 8
                patch = torch.tensor([[kind, dest.data_ptr(), n, 2, 0, where, vals, count]],
                                     dtype=torch.int64)
                t0 = time.perf_counter()
                kernels.apply_many(lib, patch)
                patches.append(time.perf_counter() - t0)
            else:
                dest.copy_(cur)
            ok = ok and torch.equal(dest.view(torch.int16), cur.view(torch.int16))
        d = _median(diffs)
        p = _median(patches) if patches else float("nan")
        print(f"{fraction:>8.1%} {1e3 * d:>9.1f} {d / read_both:>7.2f}x {1e3 * p:>9.1f} "
              f"{p / one:>7.2f}x  {ok}")


if __name__ == "__main__":
    main()
