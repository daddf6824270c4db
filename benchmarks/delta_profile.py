"""Where a delta update's time goes, in one process (no transport): the trainer's diff and
encoding of every piece, and a receiver applying the records, on a preset's shapes.

    python benchmarks/delta_profile.py --preset 8b [--fraction 0.02] [--device cuda] [--rounds 5]
        [--split 4] [--kernel-times] [--group ELEMENTS] [--gc]

``--split N``: the records made in N rounds, as an update in rounds sends them (each round
packed and applied before the next is made, its arena reused); prints what the arenas hold.
``--table``: the kernel calls worked out by the first delta update and replayed by the next
(``sender.table_for``, as an engine does while its source's tensors stay where they are);
without it every update walks the pieces.
"""

import argparse
import contextlib
import cProfile
import pstats
import time

import torch

from weightbus.engines import delta as dm
from weightbus.engines.api import _gc_paused
from weightbus.engines.delta import receiver as dr
from weightbus.engines.delta import sender as ds
from weightbus.plan import Manifest, TensorMeta
from weightbus.planning import presets


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="0.6b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--fraction", type=float, default=0.02)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--capacity-mb", type=int, default=512)
    ap.add_argument("--profile", action="store_true", help="print where the Python time went")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--split", type=int, default=1, help="rounds an update is made in")
    ap.add_argument("--table", action="store_true", help="replay the kernel calls (a DiffTable)")
    ap.add_argument("--kernel-times", action="store_true",
                    help="also time each GPU kernel by CUDA events around its launches")
    ap.add_argument("--group", type=int, help="elements diffed together on a GPU (default: the engine's)")
    ap.add_argument("--gc", action="store_true",
                    help="leave Python's collector running (an engine's update pauses it)")
    args = ap.parse_args()
    if args.group:
        ds._GROUP = args.group
    dev = torch.device(args.device)
    shapes = presets.shapes(args.preset, args.layers)
    g = torch.Generator(device=dev).manual_seed(0)
    weights = [torch.randn(s, dtype=torch.bfloat16, device=dev, generator=g) for _, s in shapes]
    manifest = Manifest(TensorMeta(n, torch.bfloat16, s) for n, s in shapes)
    dest = [w.clone().view(-1) for w in weights]
    snaps = dm.Snapshots()
    cap = args.capacity_mb << 20

    flats = [w.view(-1) for w in weights]  # (a source's pieces, made once: what is timed is ours)

    def pieces():
        for i, flat in enumerate(flats):
            yield i, 0, flat

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    timed = {}
    if args.kernel_times and dev.type == "cuda":
        from delta_gpu_kernels import _Timed  # (this folder's: CUDA events around each launch)

        from weightbus.engines.delta import gpu as delta_gpu

        ks = delta_gpu.kernels()
        timed = {name: _Timed(getattr(ks, name)) for name in ("diff", "write", "bitcount", "apply")}
        for name, t in timed.items():
            setattr(ks, name, t)

    dm.records(pieces(), manifest, snaps, True, cap)  # the full update: snapshots made
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)  # weights, receiver copies, snapshots, arena
    times = []
    for rnd in range(args.rounds):
        for w in weights:
            flat = w.view(-1)
            k = max(1, round(flat.numel() * args.fraction))
            idx = torch.randint(0, flat.numel(), (k,), device=dev, generator=g)
            flat.view(torch.int16)[idx] += 1
        sync()
        t0 = time.perf_counter()
        prof = cProfile.Profile() if rnd == args.rounds - 1 and args.profile else None
        if prof:
            prof.enable()
        # (as an update sends them: a kernel call's records stay one Block)
        total = sum(w.numel() * 2 for w in weights)
        budget = None if args.split <= 1 else [-(-total * k // args.split) for k in range(1, args.split)]
        table = ds.table_for(snaps, "pieces", flats) if args.table else None
        rounds = ds._Rounds(ds._records(pieces(), manifest, snaps, False, cap, budget, table), 1 << 62)
        n_recs = off = 0
        enc = pack = app = 0.0
        paused = contextlib.ExitStack()  # (the collector paused, as an engine's update pauses it)
        if not args.gc:
            paused.enter_context(_gc_paused())
        while True:
            t_a = time.perf_counter()
            buckets, follows, failed = rounds.take("profile")  # (one bucket holding the round's records)
            assert failed is None, failed
            recs = [it for b in buckets for it in b]
            sync()
            t_b = time.perf_counter()
            used = 8 + sum(r.size for r in recs)
            slot = torch.empty(used, dtype=torch.uint8, device=dev)
            ds._fill(slot, recs)  # (one bucket holding the round's records, for the profile)
            sync()
            t_c = time.perf_counter()
            dr._apply(slot, used, dest, manifest, False)
            sync()
            t_d = time.perf_counter()
            enc, pack, app = enc + t_b - t_a, pack + t_c - t_b, app + t_d - t_c
            n_recs, off = n_recs + len(recs), off + used
            if not follows:
                break
        paused.close()
        t0, t1, t2, t3 = 0.0, enc, enc + pack, enc + pack + app
        if prof:
            prof.disable()
        ok = all(torch.equal(a.view(-1), b) for a, b in zip(weights, dest, strict=True))
        print(f"round {rnd}: {n_recs} records or blocks, {off / 2**20:.1f} MiB of "
              f"{sum(w.numel() * 2 for w in weights) / 2**20:.1f}; encode {1e3 * (t1 - t0):.1f} ms, "
              f"pack {1e3 * (t2 - t1):.1f} ms, apply {1e3 * (t3 - t2):.1f} ms; bitwise {ok}")
        if timed:
            print("  kernels (ms): " + ", ".join(f"{k} {t.take():.1f}" for k, t in timed.items()))
        if rnd:  # (round 0 compiles and pages in)
            times.append((t1 - t0, t3 - t2))
    if times:
        enc, app = (sorted(x)[len(x) // 2] for x in zip(*times, strict=True))
        print(f"median of rounds 1-{args.rounds - 1}: encode {1e3 * enc:.1f} ms, apply {1e3 * app:.1f} ms")
    held = snaps.arenas.nbytes + sum(a.nbytes for a in snaps.device_arenas.values())
    print(f"arenas: {held / 2**20:.1f} MiB ({args.split} round(s)), block tables "
          f"{snaps.layouts.nbytes / 2**20:.1f} MiB, snapshots "
          f"{sum(t.numel() * t.element_size() for t in snaps.pieces.values()) / 2**20:.1f} MiB")
    if dev.type == "cuda":  # what else a delta update held at its peak (the profile's own slot too)
        print(f"device memory at the peak, above what was held before: "
              f"{(torch.cuda.max_memory_allocated(dev) - base) / 2**20:.1f} MiB")
    if args.profile:
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    # the floor of a dense update's work on this device: one bulk copy of the same bytes
    total = sum(w.numel() * 2 for w in weights)
    part = min(total, 4 << 30)
    a = torch.empty(part, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    t0 = time.perf_counter()
    b.copy_(a)
    sync()
    floor = (time.perf_counter() - t0) * total / part
    print(f"floor: one bulk copy of {total / 2**30:.2f} GiB on {dev.type}: {1e3 * floor:.1f} ms")


if __name__ == "__main__":
    main()
