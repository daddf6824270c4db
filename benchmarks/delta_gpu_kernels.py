"""Delta mode's GPU kernels alone (``weightbus/engines/delta_triton.py``, launched as an update
launches them): the trainer's diff of bf16 pieces against their snapshots (pass one: compare,
bits, digest, snapshot; pass two: the records' positions or bitmaps and values), and the
receiver's apply of the same records into a copy, at a few fractions changed, next to the
floor of each: one bulk copy of the bytes it must read (the diff reads the weights and the
snapshot; the apply rewrites the destination). Every kernel is timed by CUDA events around
its own launch; "diff" is the whole call, host layout included.

    python benchmarks/delta_gpu_kernels.py [--elements 268435456] [--piece 16777216]
        [--fractions 0 0.02 0.1] [--warps 8 4]
"""

import argparse
import os
import statistics

import torch

from weightbus.engines.delta import cpu as kernels
from weightbus.engines.delta import gpu


class _Timed:
    """A Triton kernel whose launches are timed by CUDA events."""

    def __init__(self, fn: object) -> None:
        self.fn, self.events = fn, []

    def __getitem__(self, grid: object) -> object:
        launch = self.fn[grid]  # type: ignore[index]

        def run(*args: object, **kwargs: object) -> None:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            launch(*args, **kwargs)
            b.record()
            self.events.append((a, b))
        return run

    def take(self) -> float:
        """Milliseconds of the launches since the last take (the device synchronized)."""
        ms = sum(a.elapsed_time(b) for a, b in self.events)
        self.events = []
        return ms


def _copy_ms(nbytes: int, dev: torch.device) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--elements", type=int, default=1 << 28)
    ap.add_argument("--piece", type=int, default=1 << 24, help="elements per piece (tensor)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.02, 0.1])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warps", type=int, nargs=2, help="warps per program of the diff's two passes")
    args = ap.parse_args()
    if args.warps:
        gpu.WARPS[:] = args.warps
    if not torch.cuda.is_available():
        raise SystemExit("no GPU")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dev = torch.device("cuda")
    ks = gpu.kernels()
    if ks is None:
        raise SystemExit("no Triton")
    timed = {name: _Timed(getattr(ks, name)) for name in ("diff", "write", "bitcount", "apply")}
    for name, t in timed.items():
        setattr(ks, name, t)
    n, piece = args.elements, args.piece
    g = torch.Generator(device=dev).manual_seed(0)
    cur = torch.randn(n, generator=g, device=dev).to(torch.bfloat16)
    snap, dest = cur.clone(), cur.clone()
    starts = list(range(0, n, piece))
    sizes = [min(piece, n - s) for s in starts]
    table = torch.tensor([[cur.data_ptr() + 2 * s for s in starts], [snap.data_ptr() + 2 * s for s in starts],
                          sizes, starts], dtype=torch.int64)
    arena, layouts = kernels.Arena(device=dev), gpu.Layouts()  # (kept between updates, as an engine does)
    read_both, one = _copy_ms(4 * n, dev), _copy_ms(2 * n, dev)
    print(f"{torch.cuda.get_device_name()}: {n} bf16 elements ({2 * n / 2**30:.2f} GiB) in {len(sizes)} "
          f"pieces; floors: a bulk copy of {4 * n / 2**30:.2f} GiB {read_both:.2f} ms, of "
          f"{2 * n / 2**30:.2f} GiB {one:.2f} ms")
    print(f"{'changed':>8} {'pass 1':>7} {'pass 2':>7} {'diff':>7} {'x floor':>8} {'apply':>7} "
          f"{'x floor':>8}  bitwise")
    for fraction in args.fractions:
        rows: dict[str, list[float]] = {"p1": [], "p2": [], "diff": [], "apply": []}
        ok = True
        for _ in range(args.rounds):
            k = int(n * fraction)
            if k:
                idx = torch.randint(0, n, (k,), generator=g, device=dev)
                cur.view(torch.int16)[idx] += 1
            arena.reset()
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            results, out = gpu.diff_many(table, 2, dev, arena, layouts)
            b.record()
            torch.cuda.synchronize()
            rows["diff"].append(a.elapsed_time(b))
            rows["p1"].append(timed["diff"].take())
            rows["p2"].append(timed["write"].take())
            kind, count, offset, nbytes = results[:, 0], results[:, 1], results[:, 3], results[:, 4]
            vals = offset + nbytes - (2 * count + 7) // 8 * 8
            patch = torch.stack([kind, torch.tensor([dest.data_ptr() + 2 * s for s in starts]),
                                 torch.tensor(sizes), torch.full_like(kind, 2), torch.tensor(starts),
                                 out.data_ptr() + offset, out.data_ptr() + vals, count], 1)
            sent = (kind == 1) | (kind == 2)
            for i in (~sent & (kind != -1)).nonzero().flatten().tolist():  # (dense: copied whole)
                dest[starts[i]:starts[i] + sizes[i]].copy_(cur[starts[i]:starts[i] + sizes[i]])
            if bool(sent.any()):
                gpu.apply_many(patch[sent], dev)
                torch.cuda.synchronize()
                rows["apply"].append(timed["bitcount"].take() + timed["apply"].take())
            ok = ok and torch.equal(dest.view(torch.int16), cur.view(torch.int16))
        m = {key: statistics.median(v) if v else float("nan") for key, v in rows.items()}
        print(f"{fraction:>8.1%} {m['p1']:>7.2f} {m['p2']:>7.2f} {m['diff']:>7.2f} "
              f"{m['diff'] / read_both:>7.2f}x {m['apply']:>7.2f} {m['apply'] / one:>7.2f}x  {ok}")


if __name__ == "__main__":
    main()
