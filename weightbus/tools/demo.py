"""``weightbus demo``: a real weight-sync loop on this machine's CPUs.

Trainer ranks train a small transformer with FSDP2 (``fully_shard`` over gloo) for a few
optimizer steps; after every step the weights (bf16 on the wire) go to the rollout
ranks through a weightbus engine, each rollout rank loads them into its own copy of the
model and is checked bitwise against the trainer's full weights. At the end the same
bytes go over the engine's own path with nothing of the engine around them (a raw
broadcast, raw one-sided writes or reads, a bulk copy): the floor it is measured against.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import mmap
import os
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry
from weightbus.engines.cache import CacheEngine
from weightbus.engines.collective import CollectiveEngine
from weightbus.engines.colocated import ColocatedEngine
from weightbus.engines.mooncake import MooncakeEngine
from weightbus.engines.nixl import NixlEngine
from weightbus.runtime.local import Rendezvous, connect, spawn
from weightbus.sinks import ModuleSink
from weightbus.sources import ModuleSource
from weightbus.tools.bench import raw_broadcast, raw_mooncake, raw_nixl

#: attention heads of the demo's model: its width must be a multiple of them
HEADS = 4
#: the cache backends: whole versions published into a directory, no buckets
CACHE_BACKENDS = ("shm", "disk")


class TinyTransformer(nn.Module):
    """A small decoder-only transformer (pre-norm blocks, causal mask, untied head)."""

    def __init__(self, vocab: int = 4096, dim: int = 256, layers: int = 4, heads: int = HEADS,
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
    #: disk: the directory this run's cache is made in (a fresh one inside it; default: the
    #: temp directory); removed at the end, like shm's
    cache_dir: str | None = None
    cache_root: str = ""  # set by run_demo: this run's own cache directory (shm, disk)

    def __post_init__(self) -> None:  # (the CLI checks each option before, naming it)
        for name in ("trainers", "rollouts", "steps", "layers", "bucket_mb"):
            if not 1 <= getattr(self, name):
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.dim < HEADS or self.dim % HEADS:
            raise ValueError(f"dim must be a positive multiple of the {HEADS} attention heads, "
                             f"got {self.dim}")

    def params(self) -> int:
        """TinyTransformer's parameter count, counted (building even a meta model of a large
        width takes seconds): embedding, head, positions, blocks of 12 d^2 + 13 d, a norm."""
        d = self.dim
        return 2 * self.vocab * d + 128 * d + self.layers * (12 * d * d + 13 * d) + 2 * d

    def host_bytes(self) -> int:
        """About the host memory the demo needs at its peak, every process together: fp32
        weights, gradients and 2 Adam moments over the trainers with their gathers and
        activations, a bf16 copy per rollout, 2 buckets per rank, each process's torch."""
        procs = self.trainers + self.rollouts + 1
        buckets = 0 if self.backend in CACHE_BACKENDS else 2 * (self.bucket_mb << 20) * (procs - 1)
        return self.params() * (20 + 2 * self.rollouts) + buckets + procs * (250 << 20)

    def shm_bytes(self) -> int:
        """/dev/shm the demo needs: shm keeps 2 bf16 versions there (and the floor's file),
        colocated its trainers' bucket rings."""
        if self.backend == "shm":
            return 3 * 2 * self.params()
        return 2 * (self.bucket_mb << 20) * self.trainers if self.backend in ("colocated", "naive") else 0


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
    place = {"path": cfg.cache_root} if cfg.backend in CACHE_BACKENDS else \
        {"bucket_size": cfg.bucket_mb << 20}
    engine: CheckpointEngine = CheckpointEngineRegistry.new(
        cfg.backend, role="trainer" if is_trainer else "rollout", timeout=cfg.timeout, **place)
    connect(engine, rdv, T, R)
    def say(what: str) -> None:  # (trainer rank 0 tells; the parent prints every line in order)
        if rank == 0:
            rdv.store.set(f"{PROGRESS}/{rdv.store.add(PROGRESS, 1)}", what)
    say(f"group formed over '{cfg.backend}'")
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
            say(f"update {step}/{cfg.steps}: {stats.bytes / 1e6:.1f} MB in {stats.seconds:.3f} s")
        else:
            sink = ModuleSink(model)
            t0 = time.perf_counter()
            asyncio.run(sink.load(engine.receive_weights()))
            seconds = time.perf_counter() - t0
            got = {n: digest(t) for n, t in model.state_dict().items()}
            rows.append({"step": step, "got": got, "version": engine.version, "seconds": seconds,
                         "bytes": engine.last_stats.bytes if engine.last_stats else 0})
    nbytes = rdv.all_gather(rows[-1]["bytes"] if rank == 0 else None)[0]
    say("measuring the floor (the same bytes over the raw path)")
    floor = _floor(engine, rdv, nbytes)
    gather = _gather_seconds(engine, model, rdv) if is_trainer else None
    if not is_trainer:
        rdv.all_gather(None)
    engine.finalize(destroy_group=True)
    return {"rank": rank, "rows": rows, "floor": floor, "gather": gather}


def _gather_seconds(engine: CheckpointEngine, model: nn.Module, rdv: Rendezvous) -> float:
    """Seconds the trainers spend gathering their FSDP2 shards for one update (the part of
    an update that is the trainer's own collective, not the link to the rollouts)."""
    source = ModuleSource(model, dtype=torch.bfloat16)
    if isinstance(engine, CacheEngine):  # trainer rank 0 writes the whole version
        owners: Callable[[int], frozenset[int]] = lambda i: frozenset({0})  # noqa: E731
        rank = engine.rank
    else:  # each tensor goes to the trainer ranks that pack it
        owners = engine._plan(source.manifest).owners_of  # type: ignore[attr-defined]
        rank = engine.trainer_rank  # type: ignore[attr-defined]
    best = math.inf
    for _ in range(3):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in source.iter_for(owners, rank):
            pass
        best = min(best, time.perf_counter() - t0)
    rdv.all_gather(None)
    return best


#: what the floor of each engine family is, for the table's footnote
FLOORS = {
    CollectiveEngine: "a raw broadcast of the same buckets over the same groups",
    NixlEngine: "raw one-sided writes of the same buckets from each trainer rank to the head of its chain",
    MooncakeEngine: "raw reads of the same buckets from the trainer ranks' slots by every rollout rank",
    ColocatedEngine: "one bulk copy of the same bytes on every rollout rank at once (the copy into the "
                     "rollout's model, which no shared-memory path skips)",
    CacheEngine: "the same bytes written once into a file in the cache's directory, then copied out of "
                 "it on every rollout rank",
}


#: what the same engine does where it is meant to run (GPUs, real models; benchmarks/RESULTS.md)
AT_SCALE = {
    CollectiveEngine: "On GPUs with real models the NCCL path runs at 1.11-1.14x of a raw broadcast "
                      "(Qwen3-8B and the 30B-A3B MoE, 2 x H200)",
    NixlEngine: "On GPUs NIXL's path runs at 1.21-1.25x of NIXL's own raw writes (8B and 30B-A3B)",
    MooncakeEngine: "mooncake reads the trainers' host-memory slots through its transfer engine: across "
                    "hosts its RDMA reads set the pace",
    ColocatedEngine: "On a GPU the colocated engine's direct mode runs at 1.5-1.9x of one bulk copy "
                     "(30B-A3B, 9,435 tensors, H100 and H200)",
    CacheEngine: "A cache is written once per version and read at each reader's pace: its cost is "
                 "per publish, not per reader",
}


def at_scale_note(backend: str) -> str:
    """What ``backend`` does on GPUs with real models, for the demo's footer."""
    cls = CheckpointEngineRegistry.get(backend)
    what = next((what for family, what in AT_SCALE.items() if issubclass(cls, family)),
                f"'{backend}' has no GPU rows yet")
    return f"{what} (benchmarks/RESULTS.md)."


def floor_note(backend: str) -> str:
    """The footnote that says what the demo's floor is for ``backend`` (or why it has none)."""
    cls = CheckpointEngineRegistry.get(backend)
    for family, what in FLOORS.items():
        if issubclass(cls, family):
            return f"floor: {what}, best of 3, same run;"
    return (f"floor: n/a: the demo knows no raw transfer for {cls.__name__} ('{backend}') to measure "
            f"(ratio: -);")


def _floor(engine: CheckpointEngine, rdv: Rendezvous, nbytes: int) -> float | None:
    """Seconds the same bytes take over the engine's own path with nothing of the engine
    around them (no packing, unpacking, control words or checks): what the link or the
    memory alone costs. Best of 3, the slowest rank's; None where no floor is known."""
    run = _floor_fn(engine, rdv, nbytes)
    if run is None:
        return None
    best = math.inf
    for _ in range(3):
        rdv.all_gather(None)  # start together
        t0 = time.perf_counter()
        run()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
        best = min(best, max(rdv.all_gather(time.perf_counter() - t0)))
    if isinstance(engine, CacheEngine) and engine.role == "trainer" and engine.rank == 0:
        os.unlink(os.path.join(engine.root, ".floor"))
    return best


def _floor_fn(engine: CheckpointEngine, rdv: Rendezvous, nbytes: int) -> Callable[[], Any] | None:
    """This rank's part of the floor (the other ranks of a one-sided transfer do nothing)."""
    nothing = lambda: None  # noqa: E731
    trainer = engine.role == "trainer"
    if isinstance(engine, CacheEngine):
        return _cache_floor(engine, rdv, nbytes)
    if isinstance(engine, ColocatedEngine):
        if trainer:
            return nothing
        src = torch.ones(nbytes, dtype=torch.uint8, device=engine.device)  # (touched: no page faults timed)
        dst = torch.zeros(nbytes, dtype=torch.uint8, device=engine.device)
        return lambda: dst.copy_(src)
    if not isinstance(engine, (CollectiveEngine, NixlEngine, MooncakeEngine)):
        return None
    plan = engine._plan(next(iter(engine._manifests.values())))
    if isinstance(engine, NixlEngine):
        return (lambda: raw_nixl(engine, plan)) if trainer else nothing
    if isinstance(engine, MooncakeEngine):
        return nothing if trainer else (lambda: raw_mooncake(engine, plan))
    bufs = [torch.empty(engine.bucket_size, dtype=torch.uint8, device=engine.device) for _ in range(2)]
    return lambda: raw_broadcast(engine, plan, bufs)


def _cache_floor(engine: CacheEngine, rdv: Rendezvous, nbytes: int) -> Callable[[], Any]:
    """Trainer rank 0 writes the bytes into a file of the cache's directory (mapped and
    flushed, as a version is; the file is kept between rounds, as the engine recycles an
    old version's), then every rollout rank copies them out of its own mapping."""
    path = os.path.join(engine.root, ".floor")  # (not a version: readers never look at it)
    writer = engine.role == "trainer" and engine.rank == 0
    src = torch.ones(nbytes, dtype=torch.uint8) if writer else None
    dst = torch.zeros(nbytes, dtype=torch.uint8) if engine.role == "rollout" else None

    def run() -> None:
        if src is not None:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                os.ftruncate(fd, max(1, nbytes))
                m = mmap.mmap(fd, max(1, nbytes), flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            torch.frombuffer(m, dtype=torch.uint8, count=nbytes).copy_(src)
            m.flush()
            m.close()
        rdv.all_gather(None)  # written: the readers start
        if dst is not None:
            with open(path, "rb") as f:
                m = mmap.mmap(f.fileno(), max(1, nbytes), access=mmap.ACCESS_COPY)
            dst.copy_(torch.frombuffer(m, dtype=torch.uint8, count=nbytes))
            m.close()
    return run


#: where trainer rank 0 says what the demo is doing (the parent prints it as it changes)
PROGRESS = "demo/progress"


def _watch(store: Any, progress: Callable[[str], None], stop: Any) -> None:
    """Print every progress line trainer rank 0 posts, in order, until ``stop`` is set."""
    said = 0
    while True:
        ending = stop.wait(0.2)  # (once told to stop: one last read, so no line is lost)
        try:
            posted = store.add(PROGRESS, 0)
            lines = [store.get(f"{PROGRESS}/{i}").decode() for i in range(said + 1, posted + 1)]
        except Exception:  # noqa: BLE001 - the store is going away with the run
            return
        for line in lines:
            progress(line)
        said = posted
        if ending:
            return


def run_demo(cfg: DemoConfig, progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Runs the demo; returns one row per update. Raises if any rank failed or any
    rollout rank's weights differ from the trainer's. ``progress(line)`` hears each step
    as it happens (the processes' start, each update, the floor)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if cfg.backend == "shm":  # a cache of this run's own (never another's), removed at the end
        cfg = replace(cfg, cache_root=CheckpointEngineRegistry.new(
            "shm", cache_name=f"demo-{os.getpid()}-{secrets.token_hex(4)}").root)  # type: ignore[attr-defined]
    elif cfg.backend == "disk":  # a fresh directory inside the given one: the owner removes its cache
        cfg = replace(cfg, cache_root=tempfile.mkdtemp(prefix="weightbus-demo-", dir=cfg.cache_dir))
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    train_store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    train_port = train_store.port
    del train_store  # frees the port for the trainers' own default group
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(store, progress, stop), daemon=True)
    if progress is not None:
        progress(f"starting {cfg.trainers + cfg.rollouts} processes")
        watcher.start()
    try:
        results = spawn(_worker, cfg.trainers + cfg.rollouts, (cfg, store.port, train_port),
                        timeout=cfg.timeout * (cfg.steps + 3))
    finally:  # the owner removes it when it finalizes; not when a rank failed before that
        stop.set()
        if watcher.is_alive():
            watcher.join(2.0)
        if cfg.cache_root:
            shutil.rmtree(cfg.cache_root, ignore_errors=True)
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
