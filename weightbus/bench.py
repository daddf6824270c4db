"""``weightbus bench``: model-shaped weight syncs, each next to its floor measured in the
same run.

Scenarios (GPU; on a machine without one the same scenarios run over gloo and shared
memory on the CPU):

- ``colocated``: trainer and rollout are two processes on one device (CUDA IPC);
  floor = the cast fp32 -> bf16 plus one device copy of the bf16 bytes.
- ``disaggregated``: trainer on device 0, rollout on device 1 (NCCL); floor = a raw
  broadcast of the same bf16 bucket bytes over the same group; baseline = cast and
  broadcast tensor by tensor, straight into the rollout's tensors.
- ``hybrid-fsdp``: 2 FSDP2 trainer ranks on 2 devices, each with a colocated rollout
  process; floor = an all-gather of the same bf16 bytes among the trainers.
- ``*-direct``: the colocated engine in direct mode: the rollout's tensors are exported
  once and the trainer writes straight into them (GPU only).

Trainer weights are fp32 and delivered as bf16; they change between iterations; after
the timed iterations every rollout tensor is checked against the trainer's (checksums
of the exact bits). Times are medians over iterations, each the slowest rank's.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightbus import comm, presets
from weightbus.engines.base import CheckpointEngine, CheckpointEngineRegistry
from weightbus.runtime.local import Rendezvous, connect, spawn
from weightbus.sinks import ModuleSink
from weightbus.sources import ModuleSource

SCENARIOS = ("colocated", "colocated-direct", "disaggregated", "hybrid-fsdp", "hybrid-fsdp-direct")
WIRE = torch.bfloat16


@dataclass
class BenchConfig:
    scenario: str = "disaggregated"
    preset: str = "tiny"
    iters: int = 5
    bucket_mb: int | None = None  # None: the engine sizes buckets from free memory
    gpu: bool = field(default_factory=torch.cuda.is_available)
    timeout: float = 300.0


# ------------------------------------------------------------------ helpers


def _device(cfg: BenchConfig, index: int) -> torch.device:
    return torch.device("cuda", index) if cfg.gpu else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer_weights(cfg: BenchConfig, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    return {n: torch.randn(s, dtype=torch.float32, device=device, generator=g)
            for n, s in presets.shapes(cfg.preset)}


def _rollout_weights(cfg: BenchConfig, device: torch.device) -> dict[str, torch.Tensor]:
    return {n: torch.zeros(s, dtype=WIRE, device=device) for n, s in presets.shapes(cfg.preset)}


def _mutate(weights: dict[str, torch.Tensor]) -> None:
    """Change every tensor's bits between iterations (a sign flip: exact, cheap)."""
    with torch.no_grad():
        for t in weights.values():
            t.neg_()


def _checksums(named: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Two integer sums over the exact 16-bit patterns of each tensor."""
    out = {}
    step = 1 << 26  # in chunks: int64 copies of a whole embedding would not fit beside 32B
    for n, t in named.items():
        flat = t.detach().reshape(-1)
        s1 = s2 = 0
        for lo in range(0, flat.numel(), step):
            v = flat[lo:lo + step].to(WIRE).view(torch.int16).to(torch.int64)
            s1 += int(v.sum())
            s2 += int((v * v).sum())
        out[n] = (s1, s2)
    return out


class _Holder(nn.Module):
    """A module whose parameters carry the preset's dotted names (for FSDP2)."""

    def __init__(self, named: dict[str, torch.Tensor]):
        super().__init__()
        for name, t in named.items():
            *path, leaf = name.split(".")
            mod: nn.Module = self
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, nn.Parameter(t, requires_grad=False))


def _timed(rdv: Rendezvous, device: torch.device, fn: Any) -> float:
    """Run ``fn`` after every rank is ready; returns the slowest rank's seconds."""
    _sync(device)
    rdv.all_gather(None)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return max(rdv.all_gather(time.perf_counter() - t0))


def _timed_peak(rdv: Rendezvous, device: torch.device, fn: Any) -> tuple[float, int]:
    """Like _timed, plus the transient device memory the call allocated at its peak."""
    if device.type != "cuda":
        return _timed(rdv, device, fn), 0
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    t = _timed(rdv, device, fn)
    return t, torch.cuda.max_memory_allocated(device) - base


def _measure(cfg: BenchConfig, rdv: Rendezvous, device: torch.device, mutate: Any,
             floor: Any, weightbus: Any, naive: Any = None) -> tuple[dict[str, list[float]], int]:
    """The timing loop every scenario shares: one warm-up round, then ``cfg.iters``
    rounds of (change the weights, floor, [naive], weightbus). Returns the times and the
    transient device memory of the weightbus calls at their peak."""
    times: dict[str, list[float]] = {"floor": [], "weightbus": []} | ({"naive": []} if naive else {})
    peak = 0
    for it in range(cfg.iters + 1):  # the first round warms up (NCCL channels, allocator)
        mutate()
        got = {"floor": _timed(rdv, device, floor)}
        if naive:
            got["naive"] = _timed(rdv, device, naive)
        got["weightbus"], peak_now = _timed_peak(rdv, device, weightbus)
        peak = max(peak, peak_now)
        if it:
            for k, v in got.items():
                times[k].append(v)
    return times, peak


def _engine_bytes(engine: CheckpointEngine) -> int:
    """Device bytes the engine holds between updates on this rank (its bucket slots)."""
    return sum(s.numel() for s in getattr(engine, "_slots", []) if s.device.type == "cuda"
               and not getattr(engine, "_ipc_imported", False))


def raw_broadcast(engine: CheckpointEngine, plan: Any, slots: list[torch.Tensor]) -> None:
    """The floor of a collective engine: the same bucket bytes broadcast over the same
    groups, two in flight, with no packing, unpacking or checks."""
    groups = engine._data  # type: ignore[attr-defined]
    works: list[Any] = []
    for b in plan.buckets:
        if b.owner in groups:
            if len(works) >= 2:
                works.pop(0).wait()
            works.append(comm.broadcast(groups[b.owner], slots[b.index % 2][: b.wire_bytes], 0))
    for w in works:
        w.wait()


def _update_fn(engine: CheckpointEngine, source: ModuleSource | None,
               weights: dict[str, torch.Tensor] | None) -> Any:
    """One weightbus update: trainers (``source``) send, rollouts load into ``weights``."""
    def update() -> None:
        if source is not None:
            asyncio.run(engine.send_weights(source))
        else:
            asyncio.run(ModuleSink(weights).load(engine.receive_weights()))  # type: ignore[arg-type]
    return update


# ------------------------------------------------------------------ workers


def _disaggregated(rank: int, cfg: BenchConfig, port: int) -> dict[str, Any]:
    device = _device(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=cfg.timeout)
    trainer = rank == 0
    weights = _trainer_weights(cfg, device) if trainer else _rollout_weights(cfg, device)
    engine = CheckpointEngineRegistry.new(
        "nccl" if cfg.gpu else "gloo", device=device, timeout=cfg.timeout,
        bucket_size=cfg.bucket_mb << 20 if cfg.bucket_mb else None, role="trainer" if trainer else "rollout")
    if not trainer:
        engine.set_destinations(weights)
    connect(engine, rdv, 1, 1)
    source = ModuleSource(weights, dtype=WIRE) if trainer else None
    plan = engine._plan(source.manifest if trainer else _manifest_of(cfg))  # type: ignore[attr-defined]
    group = engine._data[0]  # type: ignore[attr-defined]
    floor_slots = [torch.empty(engine.bucket_size, dtype=torch.uint8, device=device) for _ in range(2)]

    weightbus = _update_fn(engine, source, weights)

    def naive() -> None:
        works: list[Any] = []
        for t in weights.values():
            buf = t.to(WIRE) if trainer else t
            works.append(comm.broadcast(group, buf, 0))
            if len(works) > 8:  # bounded: each in-flight cast holds its memory
                works.pop(0).wait()
        for w in works:
            w.wait()

    times, peak = _measure(cfg, rdv, device, lambda: _mutate(weights) if trainer else None,
                           lambda: raw_broadcast(engine, plan, floor_slots), weightbus, naive)
    check = _checksums({n: t for n, t in weights.items()})
    result = {"times": times, "checksums": check, "peak_extra": peak + _engine_bytes(engine),
              "engine_buffers": engine.num_buffers * engine.bucket_size}
    engine.finalize(destroy_group=True)
    return result


def _manifest_of(cfg: BenchConfig) -> Any:
    from weightbus.plan import Manifest, TensorMeta
    return Manifest(TensorMeta(n, WIRE, s) for n, s in presets.shapes(cfg.preset))


def _colocated_engine(cfg: BenchConfig, device: torch.device, trainer: bool,
                      weights: dict[str, torch.Tensor] | None) -> CheckpointEngine:
    engine = CheckpointEngineRegistry.new(
        "colocated", device=device, timeout=cfg.timeout,
        bucket_size=cfg.bucket_mb << 20 if cfg.bucket_mb else None, role="trainer" if trainer else "rollout")
    if cfg.scenario.endswith("-direct") and not trainer:
        engine.set_destinations(weights)  # type: ignore[attr-defined,arg-type]
    return engine


def _colocated(rank: int, cfg: BenchConfig, port: int) -> dict[str, Any]:
    device = _device(cfg, 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=cfg.timeout)
    trainer = rank == 0
    weights = _trainer_weights(cfg, device) if trainer else _rollout_weights(cfg, device)
    engine = _colocated_engine(cfg, device, trainer, weights)
    connect(engine, rdv, 1, 1)
    source = ModuleSource(weights, dtype=WIRE) if trainer else None
    biggest = max(t.numel() for t in weights.values())
    scratch = [torch.empty(biggest, dtype=WIRE, device=device) for _ in range(2)] if trainer else []

    def floor() -> None:  # the cast plus one device copy of the bf16 bytes
        if trainer:
            for t in weights.values():
                n = t.numel()
                scratch[0][:n].copy_(t.view(-1))
                scratch[1][:n].copy_(scratch[0][:n])

    weightbus = _update_fn(engine, source, weights)

    times, peak = _measure(cfg, rdv, device, lambda: _mutate(weights) if trainer else None,
                           floor, weightbus)
    result = {"times": times, "checksums": _checksums(weights),
              "peak_extra": peak + _engine_bytes(engine),
              "engine_buffers": engine.num_buffers * engine.bucket_size}
    engine.finalize(destroy_group=True)
    return result


def _hybrid(rank: int, cfg: BenchConfig, port: int, train_port: int) -> dict[str, Any]:
    T = 2
    trainer = rank < T
    device = _device(cfg, rank % T)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rdv = Rendezvous("127.0.0.1", port, rank, 2 * T, timeout=cfg.timeout)
    if trainer:
        dist.init_process_group("nccl" if cfg.gpu else "gloo", init_method=f"tcp://127.0.0.1:{train_port}",
                                rank=rank, world_size=T, device_id=device if cfg.gpu else None)
        from torch.distributed.fsdp import fully_shard
        model = _Holder(_trainer_weights(cfg, device))
        fully_shard(model)
        weights = None
    else:
        weights = _rollout_weights(cfg, device)
    engine = _colocated_engine(cfg, device, trainer, weights)
    connect(engine, rdv, T, T)
    source = ModuleSource(model, dtype=WIRE) if trainer else None
    chunk = (engine.bucket_size // 2 // T) * T  # bytes per all-gather, like a bucket's worth
    total = presets.nbytes(cfg.preset, 2)
    ag_in = torch.empty(chunk // T, dtype=torch.uint8, device=device) if trainer else None
    ag_out = torch.empty(chunk, dtype=torch.uint8, device=device) if trainer else None

    def floor() -> None:  # all-gather of the same bf16 bytes among the trainers
        if trainer:
            done = 0
            while done < total:
                dist.all_gather_into_tensor(ag_out, ag_in)
                done += chunk

    weightbus = _update_fn(engine, source, weights)

    times, peak = _measure(cfg, rdv, device,
                           lambda: _mutate(dict(model.named_parameters())) if trainer else None,
                           floor, weightbus)
    if trainer:
        full = {n: t for n, t in source}  # type: ignore[union-attr]
        check = _checksums(full) if rank == 0 else None
        del full
    else:
        check = _checksums(weights)  # type: ignore[arg-type]
    result = {"times": times, "checksums": check, "peak_extra": peak + _engine_bytes(engine),
              "engine_buffers": engine.num_buffers * engine.bucket_size}
    engine.finalize(destroy_group=True)
    if trainer:
        dist.destroy_process_group()
    return result


# ------------------------------------------------------------------ driver


def fits(cfg: BenchConfig) -> str | None:
    """Why the scenario cannot fit the devices' memory (None if it fits)."""
    if not cfg.gpu:
        return None
    params = presets.nbytes(cfg.preset, 1)  # parameter count
    biggest = max(s[0] * (s[1] if len(s) > 1 else 1) for _, s in presets.shapes(cfg.preset)) * 2
    slack = 4 * 2**30 + 4 * biggest  # buckets, floor buffers, a cast tensor, allocator
    need = {"disaggregated": 4 * params, "colocated": 6 * params,
            "hybrid-fsdp": 4 * params + 2 * params}[cfg.scenario.removesuffix("-direct")] + slack
    free = torch.cuda.mem_get_info(0)[0]
    if need > free:
        return f"needs ~{need / 2**30:.0f} GiB on one GPU, {free / 2**30:.0f} GiB free"
    return None


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Runs one scenario on one preset; returns a row for the table."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    if cfg.scenario == "disaggregated":
        res = spawn(_disaggregated, 2, (cfg, store.port), timeout=cfg.timeout * 3)
        trainer, rollouts = res[0], res[1:]
    elif cfg.scenario in ("colocated", "colocated-direct"):
        res = spawn(_colocated, 2, (cfg, store.port), timeout=cfg.timeout * 3)
        trainer, rollouts = res[0], res[1:]
    elif cfg.scenario in ("hybrid-fsdp", "hybrid-fsdp-direct"):
        tmp = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
        train_port = tmp.port
        del tmp
        res = spawn(_hybrid, 4, (cfg, store.port, train_port), timeout=cfg.timeout * 3)
        trainer, rollouts = res[0], res[2:]
    else:
        raise ValueError(f"unknown scenario {cfg.scenario!r}; choose from {', '.join(SCENARIOS)}")
    nbytes = presets.nbytes(cfg.preset, 2)
    med = {k: statistics.median(v) for k, v in trainer["times"].items() if v}
    verified = all(r["checksums"] == trainer["checksums"] for r in rollouts)
    row: dict[str, Any] = {
        "scenario": cfg.scenario, "preset": cfg.preset, "device": _device_name(cfg),
        "tensors": len(presets.shapes(cfg.preset)), "bytes": nbytes,
        "bucket_bytes": trainer["engine_buffers"] // 2, "iters": cfg.iters,
        "floor_s": med["floor"], "weightbus_s": med["weightbus"], "naive_s": med.get("naive"),
        "ratio": med["weightbus"] / med["floor"],
        "naive_ratio": med["naive"] / med["floor"] if "naive" in med else None,
        "floor_gbps": nbytes / med["floor"] / 1e9, "weightbus_gbps": nbytes / med["weightbus"] / 1e9,
        "peak_extra_trainer": trainer["peak_extra"],
        "peak_extra_rollout": max(r["peak_extra"] for r in rollouts),
        "verified": verified, "all_times": trainer["times"],
    }
    return row


def _device_name(cfg: BenchConfig) -> str:
    if cfg.gpu:
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return "cpu"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'scenario':<14} {'preset':<11} {'GB':>6} {'floor ms':>9} {'naive ms':>9} {'wb ms':>9} "
            f"{'wb GB/s':>8} {'ratio':>6} {'naive':>6} {'+mem trn':>9} {'+mem roll':>9}  check")
    lines = [head]
    for r in rows:
        naive = f"{r['naive_s'] * 1e3:9.1f}" if r.get("naive_s") else f"{'-':>9}"
        nratio = f"{r['naive_ratio']:.2f}x" if r.get("naive_ratio") else "-"
        lines.append(
            f"{r['scenario']:<14} {r['preset']:<11} {r['bytes'] / 1e9:6.2f} {r['floor_s'] * 1e3:9.1f} "
            f"{naive} {r['weightbus_s'] * 1e3:9.1f} {r['weightbus_gbps']:8.1f} {r['ratio']:5.2f}x "
            f"{nratio:>6} {r['peak_extra_trainer'] / 2**30:8.2f}G {r['peak_extra_rollout'] / 2**30:8.2f}G  "
            f"{'OK' if r['verified'] else 'MISMATCH'}")
    return "\n".join(lines)


def main_bench(scenarios: list[str], presets_: list[str], iters: int, bucket_mb: int | None,
               json_path: str | None) -> int:
    rows = []
    for p in presets_:
        for s in scenarios:
            cfg = BenchConfig(scenario=s, preset=p, iters=iters, bucket_mb=bucket_mb)
            why = fits(cfg)
            if why:
                print(f"{s} {p}: skipped: {why}", flush=True)
                continue
            try:
                row = run_bench(cfg)
            except Exception as e:  # noqa: BLE001 - one scenario failing must not hide the others
                print(f"{s} {p}: FAILED: {str(e)[-2000:]}", flush=True)
                continue
            rows.append(row)
            print(format_table([row]).splitlines()[-1], flush=True)
            if json_path:
                with open(json_path, "w") as f:
                    json.dump(rows, f, indent=1, default=str)
    print()
    print(format_table(rows))
    print("floor: colocated = cast + one device copy; disaggregated = raw broadcast of the same "
          "bucket bytes; hybrid-fsdp = all-gather of the same bytes; ratio = weightbus / floor")
    return 0 if rows and all(r["verified"] for r in rows) else 1


__all__ = ["BenchConfig", "SCENARIOS", "format_table", "main_bench", "run_bench"]
