"""Update time through CheckpointEngineManager for 1, 2 and 4 rollout replicas (local
processes, this machine). Model-shaped weights (Qwen3 presets), fp32 trainer -> bf16.

    python benchmarks/manager_scaling.py [--preset tiny] [--preset 0.6b] [--backend gloo]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from weightbus import ModuleSink, ModuleSource
from weightbus.manager import CheckpointEngineManager
from weightbus.planning import presets
from weightbus.runtime.group import LocalWorkerGroup, call
from weightbus.worker import WeightbusWorker


class PresetTrainer(WeightbusWorker):
    def __init__(self, rank: int, world: int, preset: str):
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)
        self.w = {n: torch.randn(s, generator=g) for n, s in presets.shapes(preset)}

    def step(self) -> None:
        for t in self.w.values():
            t.neg_()

    def weights_source(self) -> ModuleSource:
        return ModuleSource(self.w, dtype=torch.bfloat16)

    def checksum(self) -> float:
        return float(sum(t.to(torch.bfloat16).double().sum() for t in self.w.values()))


class PresetRollout(WeightbusWorker):
    def __init__(self, rank: int, world: int, preset: str):
        torch.set_num_threads(1)
        self.w = {n: torch.zeros(s, dtype=torch.bfloat16) for n, s in presets.shapes(preset)}

    def weights_sink(self) -> ModuleSink:
        return ModuleSink(self.w)

    def checksum(self) -> float:
        return float(sum(t.double().sum() for t in self.w.values()))


def run(preset: str, backend: str, replicas: int, updates: int) -> dict:
    trainer = LocalWorkerGroup(PresetTrainer, 1, preset, name="trainer")
    reps = [LocalWorkerGroup(PresetRollout, 1, preset, name=f"r{i}") for i in range(replicas)]
    mgr = CheckpointEngineManager(backend, trainer, reps, timeout=300)
    try:
        mgr.update_weights(version=0)  # forms the group (timed separately)
        times, transfer = [], []
        for v in range(1, updates + 1):
            call(trainer, "step", timeout=60)
            rep = mgr.update_weights(version=v)
            times.append(rep.seconds)
            transfer.append(rep.phases["transfer"])
        want = call(trainer, "checksum", timeout=60)[0]
        ok = all(call(r, "checksum", timeout=60)[0] == want for r in reps)
        return {"preset": preset, "backend": backend, "replicas": replicas,
                "bytes": presets.nbytes(preset), "update_s": statistics.median(times),
                "transfer_s": statistics.median(transfer), "ok": ok}
    finally:
        mgr.shutdown()
        for g in [trainer, *reps]:
            g.shutdown()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--preset", action="append")
    p.add_argument("--backend", default="gloo")
    p.add_argument("--updates", type=int, default=3)
    a = p.parse_args()
    print(f"{'preset':<8} {'backend':<8} {'replicas':>8} {'MB':>8} {'update ms':>10} {'transfer ms':>11} "
          f"{'GB/s/replica':>12}  check")
    for preset in a.preset or ["tiny", "0.6b"]:
        for n in (1, 2, 4):
            r = run(preset, a.backend, n, a.updates)
            print(f"{preset:<8} {a.backend:<8} {n:>8} {r['bytes'] / 1e6:>8.1f} {r['update_s'] * 1e3:>10.1f} "
                  f"{r['transfer_s'] * 1e3:>11.1f} {r['bytes'] / r['transfer_s'] / 1e9:>12.2f}  "
                  f"{'OK' if r['ok'] else 'MISMATCH'}", flush=True)
