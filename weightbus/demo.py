"""``weightbus demo``: a real weight-sync loop on this machine's CPUs.

Trainer ranks train a small transformer with FSDP2 (``fully_shard`` over gloo) for a few
optimizer steps; after every step the weights (bf16 on the wire) go to the rollout
ranks through a weightbus engine, each rollout rank loads them into its own copy of the
model and is checked bitwise against the trainer's full weights. At the end the same
bytes are broadcast raw over the same groups: the floor the engine is measured against.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightbus.bench import raw_broadcast
from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry
from weightbus.runtime.local import Rendezvous, connect, spawn
from weightbus.sinks import ModuleSink
from weightbus.sources import ModuleSource


class TinyTransformer(nn.Module):
    """A small decoder-only transformer (pre-norm blocks, causal mask, untied head)."""

    def __init__(self, vocab: int = 4096, dim: int = 256, layers: int = 4, heads: int = 4,
                 max_len: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                       norm_first=True) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos[:n]
        mask = nn.Transformer.generate_square_subsequent_mask(n)
        for blk in self.blocks:
            x = blk(x, src_mask=mask, is_causal=True)
        return self.head(self.norm(x))


def digest(t: torch.Tensor) -> str:
    """A bitwise fingerprint of a tensor's dtype, shape and bytes."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes() if t.numel() else b""
    return f"{t.dtype}{list(t.shape)}:{hashlib.sha256(raw).hexdigest()[:32]}"


@dataclass
class DemoConfig:
    backend: str = "gloo"
    trainers: int = 2
    rollouts: int = 2
    steps: int = 3
    dim: int = 512
    layers: int = 4
    vocab: int = 8192
    bucket_mb: int = 16
    timeout: float = 120.0


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, vocab: int, rank: int) -> float:
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (4, 64), generator=g)
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    with torch.no_grad():
        model.steps += 1
    return float(loss.detach())


def _worker(rank: int, cfg: DemoConfig, port: int, train_port: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    T, R = cfg.trainers, cfg.rollouts
    is_trainer = rank < T
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=cfg.timeout)
    torch.manual_seed(0)
    model = TinyTransformer(cfg.vocab, cfg.dim, cfg.layers)
    if is_trainer:  # the trainer's own world: FSDP2 over gloo, unrelated to weightbus's groups
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{train_port}", rank=rank,
                                world_size=T)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (T,))  # CPU shards even where CUDA exists
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        model = model.to(torch.bfloat16)
    engine: CheckpointEngine = CheckpointEngineRegistry.new(
        cfg.backend, bucket_size=cfg.bucket_mb << 20, role="trainer" if is_trainer else "rollout",
        timeout=cfg.timeout)
    connect(engine, rdv, T, R)
    rows = []
    for step in range(1, cfg.steps + 1):
        loss = _train_step(model, opt, step, cfg.vocab, rank) if is_trainer else 0.0
        rdv.all_gather(None)  # every rank starts the update together: time the sync alone
        if is_trainer:
            source = ModuleSource(model, dtype=torch.bfloat16)
            stats = asyncio.run(engine.send_weights(source, version=step))
            # the trainer's full weights as the rollout must hold them (gathered after the sync)
            expected = {n: digest(t.to(source.wire_dtype(t))) for n, t in source}
            rows.append({"step": step, "loss": loss, "expected": expected if rank == 0 else None,
                         "seconds": stats.seconds, "bytes": stats.bytes})
        else:
            sink = ModuleSink(model)
            t0 = time.perf_counter()
            asyncio.run(sink.load(engine.receive_weights()))
            seconds = time.perf_counter() - t0
            got = {n: digest(t) for n, t in model.state_dict().items()}
            rows.append({"step": step, "got": got, "version": engine.version, "seconds": seconds,
                         "bytes": engine.last_stats.bytes if engine.last_stats else 0})
    floor = _floor(engine, rdv, T, R, cfg) if cfg.backend == "gloo" else None
    gather = _gather_seconds(engine, model, rdv) if is_trainer else None
    if not is_trainer:
        rdv.all_gather(None)
    engine.finalize(destroy_group=True)
    return {"rank": rank, "rows": rows, "floor": floor, "gather": gather}


def _gather_seconds(engine: CheckpointEngine, model: nn.Module, rdv: Rendezvous) -> float:
    """Seconds the trainers spend gathering their FSDP2 shards for one update (the part of
    an update that is the trainer's own collective, not the link to the rollouts)."""
    source = ModuleSource(model, dtype=torch.bfloat16)
    plan = engine._plan(source.manifest)  # type: ignore[attr-defined]
    rank = engine.trainer_rank  # type: ignore[attr-defined]
    best = math.inf
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in source.iter_for(plan.owners_of, rank):
            pass
        best = min(best, time.perf_counter() - t0)
    rdv.all_gather(None)
    return best


def _floor(engine: CheckpointEngine, rdv: Rendezvous, T: int, R: int, cfg: DemoConfig) -> float:
    """Seconds for a raw broadcast of the same buckets over the engine's own data groups
    (no packing, no unpacking, no checks): what the link alone costs."""
    plan = engine._plan(next(iter(engine._manifests.values())))  # type: ignore[attr-defined]
    bufs = [torch.empty(engine.bucket_size, dtype=torch.uint8) for _ in range(2)]
    best = math.inf
    for _ in range(3):
        rdv.all_gather(None)  # start together
        t0 = time.perf_counter()
        raw_broadcast(engine, plan, bufs)
        best = min(best, max(rdv.all_gather(time.perf_counter() - t0)))
    return best


def run_demo(cfg: DemoConfig) -> list[dict[str, Any]]:
    """Runs the demo; returns one row per update. Raises if any rank failed or any
    rollout rank's weights differ from the trainer's."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    train_store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    train_port = train_store.port
    del train_store  # frees the port for the trainers' own default group
    results = spawn(_worker, cfg.trainers + cfg.rollouts, (cfg, store.port, train_port),
                    timeout=cfg.timeout * (cfg.steps + 3))
    trainer0 = results[0]
    report = []
    for i, row in enumerate(trainer0["rows"]):
        expected = row["expected"]
        checks = []
        for r in results[cfg.trainers:]:
            got = r["rows"][i]
            bad = [n for n in expected if got["got"].get(n) != expected[n]]
            checks.append(not bad and got["version"] == row["step"] and set(got["got"]) == set(expected))
        seconds = max([r["rows"][i]["seconds"] for r in results])
        report.append({"step": row["step"], "loss": row["loss"], "bytes": row["bytes"],
                       "seconds": seconds, "gbps": row["bytes"] / seconds / 1e9,
                       "verified": all(checks)})
    floor = trainer0["floor"]
    for row in report:
        row["gather_seconds"] = max(r["gather"] for r in results[:cfg.trainers])
        if floor:
            row["floor_seconds"] = floor
            row["floor_gbps"] = row["bytes"] / floor / 1e9
    return report
