"""Fully-async on a cache next to the synchronized update, on this machine (CPU).

    python benchmarks/cache_bench.py --preset 0.6b --iters 3

Per preset (fp32 trainer weights, bf16 on the wire), in the same run: how long a publish
into the ``shm`` cache blocks the trainer, how long a replica's pull of the newest version
into its bf16 model takes (another process), the floor of a pull (one bulk copy of the
same bytes out of the mapped file), and the synchronized gloo update of the same model
(``weightbus bench --scenario disaggregated``, which blocks the trainer for the whole
transfer). Every pull is checked bitwise against the published weights.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import time

import torch

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource
from weightbus.tools.bench import BenchConfig, run_bench


def _weights(preset: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = BenchConfig(scenario="disaggregated", preset=preset, gpu=False).shapes()
    return {n: torch.randn(s, generator=g).to(dtype) for n, s in shapes}


def _reader(preset: str, name: str, iters: int, ready, go, out) -> None:
    torch.set_num_threads(1)
    model = _weights(preset, torch.bfloat16)
    engine = CheckpointEngineRegistry.new("shm", cache_name=name, timeout=120).connect("rollout")
    expect = _weights(preset, torch.float32)
    ready.set()
    times, floors, ok = [], [], True
    for v in range(1, iters + 1):
        go.wait(120)
        go.clear()
        t0 = time.perf_counter()
        stream = engine.get_weights(newer_than=v - 1)
        asyncio.run(ModuleSink(model).load(stream))
        times.append(time.perf_counter() - t0)
        ok = ok and engine.version == v
        # the floor: one bulk copy of the same number of bytes
        flat = torch.zeros(sum(t.numel() for t in model.values()), dtype=torch.bfloat16)
        src = torch.ones_like(flat)  # (both touched before the clock starts)
        t0 = time.perf_counter()
        flat.copy_(src)
        floors.append(time.perf_counter() - t0)
        ok = ok and all(torch.equal(model[n], (t * (-1) ** v).to(torch.bfloat16)) for n, t in expect.items())
        ready.set()
    out.put((times, floors, ok))


def run(preset: str, iters: int) -> dict[str, object]:
    name = f"bench{os.getpid()}"
    weights = _weights(preset, torch.float32)
    base = {n: t.clone() for n, t in weights.items()}
    pub = CheckpointEngineRegistry.new("shm", cache_name=name, timeout=120).connect("trainer")
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    p = ctx.Process(target=_reader, args=(preset, name, iters, ready, go, out))
    p.start()
    blocked = []
    try:
        for v in range(1, iters + 1):
            ready.wait(300)
            ready.clear()
            for n, t in weights.items():  # the weights change: sign flips, bitwise checkable
                t.copy_(base[n] * (-1) ** v)
            t0 = time.perf_counter()
            asyncio.run(pub.send_weights(ModuleSource(weights, dtype=torch.bfloat16), version=v))
            blocked.append(time.perf_counter() - t0)
            go.set()
        pulls, floors, ok = out.get(timeout=600)
    finally:
        p.join(60)
        pub.finalize(destroy_group=True)
    sync = run_bench(BenchConfig(scenario="disaggregated", preset=preset, iters=iters, gpu=False,
                                 timeout=300))
    # the first two publishes make their files; from the third on a leaving version's file
    # is reused (the steady state)
    return {"preset": preset, "first_ms": 1e3 * blocked[0],
            "publish_ms": 1e3 * statistics.median(blocked[2:]),
            "pull_ms": 1e3 * statistics.median(pulls), "pull_floor_ms": 1e3 * statistics.median(floors),
            "sync_ms": 1e3 * sync["weightbus_s"],
            "ok": ok and sync["verified"]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", action="append", help="bench presets (default: tiny, 0.6b)")
    ap.add_argument("--iters", type=int, default=6, help="publishes (at least 3)")
    a = ap.parse_args()
    print("| preset | trainer blocked, first publish ms | trainer blocked per publish (steady) ms "
          "| replica pull ms | pull floor (bulk copy) ms | synchronized gloo update ms | check |")
    print("|---|---|---|---|---|---|---|")
    for preset in a.preset or ["tiny", "0.6b"]:
        r = run(preset, a.iters)
        print(f"| {r['preset']} | {r['first_ms']:.1f} | {r['publish_ms']:.1f} | {r['pull_ms']:.1f} "
              f"| {r['pull_floor_ms']:.1f} "
              f"| {r['sync_ms']:.1f} | {'OK' if r['ok'] else 'MISMATCH'} |", flush=True)
