"""``weightbus bench``: model-shaped weight syncs, each next to its floor measured in the
same run.

Scenarios (GPU; on a machine without one the same scenarios run over gloo and shared
memory on the CPU):

- ``colocated``: trainer and rollout are two processes on one device (CUDA IPC);
  floor = the cast fp32 -> bf16 plus one device copy of the bf16 bytes.
- ``disaggregated``: trainer on device 0, rollout on device 1 (NCCL); floor = a raw
  broadcast of the same bf16 bucket bytes over the same group; baseline = cast and
  broadcast tensor by tensor, straight into the rollout's tensors. With ``trainers`` > 1
  the trainers are FSDP2 ranks each holding its dim-0 shard of every tensor (devices
  ``0..trainers-1``, the rollouts after them), and each bucket goes from the rank that
  packs it.
- ``hybrid-fsdp``: 2 FSDP2 trainer ranks on 2 devices, each with a colocated rollout
  process; floor = an all-gather of the same bf16 bytes among the trainers.
- ``*-direct``: the colocated engine in direct mode: the rollout's tensors are exported
  once and the trainer writes straight into them (GPU only).

Every floor is physical: one bulk operation on the same bytes (a cast-copy per large
chunk, a broadcast per bucket, an all-gather per chunk); the per-tensor loop is the
``naive`` column, a baseline, not a floor. Trainer weights are fp32 (``trainer_dtype``)
and delivered as bf16; they change between iterations; after the timed iterations every
rollout tensor is checked against the trainer's (checksums of the exact bits). Times are
medians over iterations, each the slowest rank's.
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

from weightbus import comm
from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry
from weightbus.packing.shards import Box, chunk_box
from weightbus.planning import presets
from weightbus.planning.simulate import served_fp8
from weightbus.quant import FP8, Fp8Format, QuantizedSource
from weightbus.runtime.local import Rendezvous, connect, spawn
from weightbus.sinks import ModuleSink
from weightbus.sources import ModuleSource

SCENARIOS = ("colocated", "colocated-direct", "disaggregated", "hybrid-fsdp", "hybrid-fsdp-direct")
#: engines the disaggregated scenario can run (the floor is each one's raw transfer)
DISAGG_BACKENDS = ("gloo", "nccl", "nixl", "mooncake")
WIRE = torch.bfloat16
TRAINER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: elements per bulk operation of the floors ("one cast or copy per large chunk")
FLOOR_CHUNK = 1 << 28
#: the per-tensor baseline is left out above this many tensors (stress presets)
NAIVE_MAX_TENSORS = 20_000


@dataclass
class BenchConfig:
    scenario: str = "disaggregated"
    preset: str = "tiny"
    iters: int = 5
    bucket_mb: int | None = None  # None: the engine sizes buckets from free memory
    gpu: bool = field(default_factory=torch.cuda.is_available)
    timeout: float = 300.0
    trainer_dtype: str = "fp32"  # the trainer's weights: fp32 (cast on the way) or bf16
    layers: int | None = None  # only the first N decoder layers of the preset
    #: disaggregated: the engine (None: nccl on a GPU, gloo without) and how many rollouts
    backend: str | None = None
    receivers: int = 1
    topology: str | None = None  # nixl: chain, tree, direct or auto (its default)
    #: disaggregated: also time a delta-mode update after the dense one, each round changing
    #: this fraction of the trainer's elements (one bf16 step each), and report both
    delta: float | None = None
    #: disaggregated: also time a sharded update to the receivers as the tensor-parallel
    #: ranks of one replica (each keeps its rows of every matrix, the rest whole) next to
    #: the dense one (the broadcast row), and report the bytes each rank received
    rollout_tp: int | None = None
    #: with ``rollout_tp``: the receivers are this many replicas of ``rollout_tp`` ranks
    replicas: int = 1
    #: with ``rollout_tp``: also time the sharded update relayed between the replicas
    #: (the engines' ``relay=k``: the trainer feeds the first replica, which forwards)
    relay: int | None = None
    #: disaggregated: trainer ranks, FSDP2-sharded (each holds its dim-0 shard of every
    #: tensor); every update's buckets are spread over them
    trainers: int = 1
    #: colocated scenarios: the rollout serves its linear weights in block fp8 (e4m3, one
    #: float32 scale per 128x128 block, as a Qwen3-FP8 checkpoint), so the trainer's source
    #: quantizes them on the way (``QuantizedSource``); the floor is one bulk cast of the
    #: same elements (to e4m3 for those, to bf16 for the rest)
    fp8: bool = False

    def __post_init__(self) -> None:
        presets.check(self.preset, self.layers)
        if isinstance(self.iters, bool) or not isinstance(self.iters, int) or self.iters < 1:
            raise ValueError(f"iters must be an int >= 1 (timed iterations), got {self.iters!r}")
        mb = self.bucket_mb
        if mb is not None and (isinstance(mb, bool) or not isinstance(mb, int) or mb < 1):
            raise ValueError(f"bucket_mb must be None or an int >= 1 (MiB), got {self.bucket_mb!r}")
        if self.scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; choose from {', '.join(SCENARIOS)}")
        if self.backend is not None and self.backend not in DISAGG_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(DISAGG_BACKENDS)}, got {self.backend!r}")
        if self.backend is not None and self.scenario != "disaggregated":
            raise ValueError("backend= applies to the disaggregated scenario only")
        if self.delta is not None and not (isinstance(self.delta, float) and 0 < self.delta <= 1):
            raise ValueError(f"delta must be a fraction of elements in (0, 1], got {self.delta!r}")
        if self.delta is not None and self.scenario != "disaggregated":
            raise ValueError("delta= applies to the disaggregated scenario (the colocated engine's floor "
                             "is a bulk copy on the same device: there is no link to spare)")
        if self.topology is not None and self.engine != "nixl":
            raise ValueError("topology= applies to the nixl backend only")
        if not isinstance(self.receivers, int) or self.receivers < 1:
            raise ValueError(f"receivers must be an int >= 1, got {self.receivers!r}")
        tp = self.rollout_tp
        if tp is not None:
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ValueError(f"rollout_tp must be an int >= 1 (TP ranks of each replica), got {tp!r}")
            if self.scenario != "disaggregated" or self.engine not in ("gloo", "nccl"):
                raise ValueError("rollout_tp= applies to the disaggregated scenario over gloo or nccl "
                                 "(sharded receive is point to point over their groups)")
            r = self.replicas
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ValueError(f"replicas must be an int >= 1, got {r!r}")
            if self.receivers not in (1, tp * r):
                raise ValueError(f"rollout_tp={tp} x replicas={r} makes {tp * r} receivers; "
                                 f"receivers={self.receivers} disagrees")
            self.receivers = tp * r
            k = self.relay
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
                raise ValueError(f"relay must be an int >= 1 (1: a chain, k: a k-ary tree), got {k!r}")
        elif self.replicas != 1 or self.relay is not None:
            raise ValueError("replicas= and relay= apply to sharded rows: give rollout_tp= too")
        T = self.trainers
        if isinstance(T, bool) or not isinstance(T, int) or T < 1:
            raise ValueError(f"trainers must be an int >= 1 (FSDP2 trainer ranks), got {T!r}")
        if T > 1 and (self.scenario != "disaggregated" or self.engine not in ("gloo", "nccl")):
            raise ValueError("trainers= applies to the disaggregated scenario over gloo or nccl "
                             "(the other scenarios fix their trainers)")
        if self.gpu and T + self.receivers > 2 and torch.cuda.device_count() < T + self.receivers:
            raise ValueError(f"{T} trainer(s) and {self.receivers} receivers on GPUs need "
                             f"{T + self.receivers} of them (one per rank); this machine has "
                             f"{torch.cuda.device_count()}")
        if self.fp8 and not self.scenario.startswith("colocated"):
            raise ValueError("fp8= applies to the colocated scenarios (a rollout serving fp8 on the "
                             "trainer's device)")
        if self.trainer_dtype not in TRAINER_DTYPES:
            raise ValueError(f"trainer_dtype must be one of {', '.join(TRAINER_DTYPES)}, "
                             f"got {self.trainer_dtype!r}")

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return presets.shapes(self.preset, self.layers)

    def label(self) -> str:
        return self.preset + (f"/{self.layers}L" if self.layers else "")

    @property
    def engine(self) -> str:
        return self.backend or ("nccl" if self.gpu else "gloo")

    def row_name(self) -> str:
        """The scenario as the table shows it: with its engine and receivers when chosen."""
        if self.scenario != "disaggregated" or (self.backend is None and self.receivers == 1
                                                 and self.trainers == 1):
            return self.scenario + (" fp8" if self.fp8 else "")
        shape = f" {self.topology}" if self.topology else ""
        return f"disagg {self.engine}{shape} {self.trainers}->{self.receivers}" \
            + (" TP" if self.rollout_tp else "") + (f"x{self.replicas}" if self.replicas > 1 else "")


# ------------------------------------------------------------------ helpers


def _device(cfg: BenchConfig, index: int) -> torch.device:
    return torch.device("cuda", index) if cfg.gpu else torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _trainer_weights(cfg: BenchConfig, device: torch.device) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(0)
    dtype = TRAINER_DTYPES[cfg.trainer_dtype]
    return {n: torch.randn(s, dtype=dtype, device=device, generator=g) for n, s in cfg.shapes()}


def _fp8_formats(cfg: BenchConfig) -> dict[str, Fp8Format]:
    """``fp8``: the weights the rollout serves in block fp8 (a Qwen3-FP8 checkpoint's)."""
    return {n: Fp8Format("block") for n, s in cfg.shapes() if cfg.fp8 and served_fp8(n, s)}


def _rollout_weights(cfg: BenchConfig, device: torch.device) -> dict[str, torch.Tensor]:
    fp8 = _fp8_formats(cfg)
    out = {}
    for n, s in cfg.shapes():
        fmt = fp8.get(n)
        out[n] = torch.zeros(s, dtype=WIRE if fmt is None else FP8, device=device)
        if fmt is not None:
            out[fmt.scale_name(n)] = torch.zeros(fmt.scale_shape(s), dtype=torch.float32, device=device)
    return out


def _served(cfg: BenchConfig, trainer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the rollout holds after an update, made from the trainer's weights on the
    plain path (torch ops a tensor at a time, not the engine's): every tensor in bf16,
    and with ``fp8`` each served weight as vLLM's quantizer makes it, then its scale."""
    fp8 = _fp8_formats(cfg)
    out = {}
    for n, t in trainer.items():
        fmt = fp8.get(n)
        if fmt is None:
            out[n] = t.to(WIRE)
        else:
            out[n], out[fmt.scale_name(n)] = fmt.quantize(t.to(WIRE))
    return out


def _bulk_cast_copy(cfg: BenchConfig, device: torch.device) -> Any:
    """The colocated floor: the same number of elements cast-copied from the trainer's
    dtype into bf16 in a few bulk operations (one per ``FLOOR_CHUNK`` elements); with
    ``fp8``, those of the served weights cast into e4m3."""
    fp8 = _fp8_formats(cfg)
    parts = [(sum(_numel(s) for n, s in cfg.shapes() if (n in fp8) == q), FP8 if q else WIRE)
             for q in (True, False)]
    biggest = min(max(k for k, _ in parts), FLOOR_CHUNK)
    src = torch.empty(biggest, dtype=TRAINER_DTYPES[cfg.trainer_dtype], device=device)
    dsts = {d: torch.empty(min(biggest, k), dtype=d, device=device) for k, d in parts if k}

    def floor() -> None:
        for total, dtype in parts:
            done = 0
            while done < total:
                k = min(biggest, total - done)
                dsts[dtype][:k].copy_(src[:k])
                done += k
    return floor


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _mutate_fraction(weights: dict[str, torch.Tensor], fraction: float, step: int) -> None:
    """Change about ``fraction`` of every tensor's elements by one bf16 step (what an
    optimizer step at RL learning rates does to a few percent of the weights)."""
    with torch.no_grad():
        for i, t in enumerate(weights.values()):
            flat = (t.to_local() if hasattr(t, "to_local") else t).view(-1)  # (FSDP2: this rank's rows)
            if not flat.numel():
                continue
            k = max(1, round(flat.numel() * fraction))
            g = torch.Generator(device=t.device).manual_seed(step * 100003 + i)
            idx = torch.randint(0, flat.numel(), (k,), device=t.device, generator=g)
            if t.dtype == torch.float32:  # one step of its bf16 rounding
                flat.view(torch.int32)[idx] += 1 << 16
            else:
                flat.view(torch.int16)[idx] += 1


def _mutate(weights: dict[str, torch.Tensor]) -> None:
    """Change every tensor's bits between iterations (a sign flip: exact, cheap)."""
    with torch.no_grad():
        for t in weights.values():
            t.neg_()


_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32}


def _checksums(named: dict[str, torch.Tensor], wire: bool = True) -> dict[str, tuple[int, int]]:
    """Two integer sums over the exact bit patterns of each tensor (cast to bf16 first,
    as they travel, where ``wire``)."""
    out = {}
    step = 1 << 26  # in chunks: int64 copies of a whole embedding would not fit beside 32B
    for n, t in named.items():
        flat = t.detach().reshape(-1)
        s1 = s2 = 0
        for lo in range(0, flat.numel(), step):
            v = flat[lo:lo + step]
            v = v.to(WIRE) if wire else v
            v = v.view(_BITS[v.element_size()]).to(torch.int64)
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


def _profiled(name: str, rank: int, fn: Any) -> Any:
    """``fn``, or, where ``WEIGHTBUS_BENCH_PROFILE`` names this column (``weightbus``,
    ``sharded``, ...) on ``rank`` (``WEIGHTBUS_BENCH_PROFILE_RANK``, default 0), ``fn``
    under cProfile, printing its top functions by own time: where a row's host time goes."""
    if os.environ.get("WEIGHTBUS_BENCH_PROFILE") != name \
            or int(os.environ.get("WEIGHTBUS_BENCH_PROFILE_RANK", "0")) != rank:
        return fn

    def run() -> None:
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        fn()
        prof.disable()
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
        print(f"--- cProfile of {name!r} on rank {rank}\n" + out.getvalue(), flush=True)
    return run


def _measure(cfg: BenchConfig, rdv: Rendezvous, device: torch.device, mutate: Any,
             floor: Any, weightbus: Any, naive: Any = None, delta: Any = None,
             more: dict[str, Any] | None = None) -> tuple[dict[str, list[float]], int]:
    """The timing loop every scenario shares: one warm-up round (two with delta), then ``cfg.iters``
    rounds of (change the weights, floor, [naive], weightbus, [delta], then each of
    ``more`` in order: name -> call). Returns the times and the transient device memory
    of the weightbus calls at their peak."""
    if naive is not None and len(cfg.shapes()) > NAIVE_MAX_TENSORS:
        naive = None  # a collective per tensor would take minutes per round
    more = more or {}
    times: dict[str, list[float]] = {"floor": [], "weightbus": []} | ({"naive": []} if naive else {}) \
        | ({"delta": []} if delta is not None else {}) | {k: [] for k in more}
    peak = 0
    # the first round warms up (NCCL channels, allocator); with delta a second: the first's
    # delta update is full (nothing held yet), so the second is its first delta, which
    # compiles the diff and apply kernels (seconds on a GPU; it was timed as a round before)
    warm = 2 if delta is not None else 1
    for it in range(1 - warm, cfg.iters + 1):
        mutate()
        got = {"floor": _timed(rdv, device, floor)}
        if naive:
            got["naive"] = _timed(rdv, device, naive)
        got["weightbus"], peak_now = _timed_peak(
            rdv, device, _profiled("weightbus", rdv.rank, weightbus) if it == cfg.iters else weightbus)
        peak = max(peak, peak_now)
        if delta is not None:
            got["delta"], delta_peak = _timed_peak(
                rdv, device, _profiled("delta", rdv.rank, delta) if it == cfg.iters else delta)
            if it > 0:  # (the warm-up round allocates the snapshots, counted apart)
                times.setdefault("delta_peak", [0.0])[0] = max(times.get("delta_peak", [0.0])[0], delta_peak)
        for k, fn in more.items():
            got[k] = _timed(rdv, device, _profiled(k, rdv.rank, fn) if it == cfg.iters else fn)
        if it > 0:
            for k, v in got.items():
                times[k].append(v)  # (delta_peak is kept apart: a maximum, not a timing)
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


def raw_sends(groups: dict[int, Any], rank: int, senders: int, counts: list[int], chunk: int,
              slots: list[torch.Tensor]) -> None:
    """The floor of sharded receive: receiver ``i`` (rank ``senders + i``) gets its
    ``counts[i]`` bytes point to point in chunks of ``chunk`` (a bucket), chunk ``j`` from
    trainer rank ``j % senders`` over that trainer's data group (the trainer at group rank
    0, receiver ``i`` at ``1 + i``); a trainer takes its receivers in turn, two chunks in
    flight per receiver, a receiver keeps ``len(slots)`` in flight; no packing, unpacking,
    relay or checks. A relayed update's floor is the same call with the bytes the senders
    send (to the first replica only): forwarding adds hops, not bytes on the senders'
    link."""
    sizes = [[(j, min(chunk, c - lo)) for j, lo in enumerate(range(0, c, chunk))] for c in counts]
    trainer = rank < senders
    if trainer:
        lists = [[(j, n) for j, n in mine if j % senders == rank] for mine in sizes]
        depth = 2
    else:
        lists = [sizes[rank - senders]]
        depth = len(slots)
    works: list[list[Any]] = [[] for _ in lists]
    for k in range(max((len(p) for p in lists), default=0)):
        for i, mine in enumerate(lists):
            if k >= len(mine):
                continue
            if len(works[i]) >= depth:
                works[i].pop(0).wait()
            j, n = mine[k]
            buf = slots[k % len(slots)][:n]
            works[i].append(groups[rank].send([buf], 1 + i, 0) if trainer
                            else groups[j % senders].recv([buf], 0, 0))
    for w in works:
        for x in w:
            x.wait()


def raw_nixl(engine: CheckpointEngine, plan: Any) -> None:
    """The floor of the nixl engine: the same bucket bytes written one-sided from the
    trainer's slots to each head of its tree (one head for a chain), two in flight per head,
    with no packing, credits, forwarding or checks (forwarding adds hops, not bytes on the
    trainer's link)."""
    agent, slots, peers = engine._agent, engine._slots, engine._peers  # type: ignore[attr-defined]
    routes = engine._routes  # type: ignore[attr-defined]
    if engine.trainer_rank not in routes:  # routes come with the first update's header: the
        return  # warm-up round's floor (not counted) runs before it
    heads = [(h, peers[h]) for h in routes[engine.trainer_rank][1]]
    mem = engine._mem  # type: ignore[attr-defined]
    pending: list[Any] = []

    def wait(h: Any) -> None:
        while agent.check_xfer_state(h) == "PROC":
            pass
        agent.release_xfer_handle(h)

    for b in plan.buckets:
        if b.owner != engine.trainer_rank:  # (several trainer ranks: each writes its own buckets)
            continue
        while len(pending) >= 2 * len(heads):
            wait(pending.pop(0))
        src = slots[b.index % len(slots)]
        local = agent.get_xfer_descs([(src.data_ptr(), b.wire_bytes, src.device.index or 0)], mem)
        for name, their_slots in heads:
            addr, _, dev = their_slots[b.index % len(their_slots)]
            h = agent.initialize_xfer("WRITE", local, agent.get_xfer_descs([(addr, b.wire_bytes, dev)], mem),
                                      name)
            agent.transfer(h)
            pending.append(h)
    for h in pending:
        wait(h)


def raw_mooncake(engine: CheckpointEngine, plan: Any) -> None:
    """The floor of the mooncake engine, on a receiver: the same bucket bytes read from the
    trainer ranks' slots, two in flight, with no control words, relay, unpacking or checks
    (every receiver reads at once, as the engine's replica leaders do)."""
    te, slots = engine._te, engine._slots  # type: ignore[attr-defined]
    sources = engine._sources  # type: ignore[attr-defined]  # trainer rank -> (session, slot addrs)
    pending: list[int] = []

    def wait(batch: int) -> None:
        while (state := te.transfer_check_status(batch)) == 0:
            pass
        if state < 0:
            raise RuntimeError(f"raw mooncake read failed with status {state}")

    for b in plan.buckets:
        if len(pending) >= 2:
            wait(pending.pop(0))
        session, addrs = sources[b.owner]  # each bucket from the trainer rank that packs it
        pending.append(te.batch_transfer_async_read(session, [slots[b.index % len(slots)].data_ptr()],
                                                    [addrs[b.index % len(addrs)]], [b.wire_bytes]))
    for batch in pending:
        wait(batch)


def _update_fn(engine: CheckpointEngine, source: ModuleSource | None,
               weights: dict[str, torch.Tensor] | None) -> Any:
    """One weightbus update: trainers (``source``) send, rollouts load into ``weights`` (one
    sink for every update, as a rollout worker keeps one for its model)."""
    sink = ModuleSink(weights) if source is None else None  # type: ignore[arg-type]

    def update() -> None:
        if source is not None:
            asyncio.run(engine.send_weights(source))
        else:
            asyncio.run(sink.load(engine.receive_weights()))  # type: ignore[union-attr]
    return update


# ------------------------------------------------------------------ workers


def _fsdp_weights(cfg: BenchConfig, device: torch.device, rank: int, train_port: int) -> dict[str, Any]:
    """The trainer's weights as ``cfg.trainers`` FSDP2 ranks hold them: every parameter a
    DTensor of which this rank keeps its dim-0 shard (the trainers' own process group)."""
    dist.init_process_group("nccl" if cfg.gpu else "gloo", init_method=f"tcp://127.0.0.1:{train_port}",
                            rank=rank, world_size=cfg.trainers, device_id=device if cfg.gpu else None)
    from torch.distributed.fsdp import fully_shard
    model = _Holder(_trainer_weights(cfg, device))
    fully_shard(model)
    return dict(model.named_parameters())


def _disaggregated(rank: int, cfg: BenchConfig, port: int, train_port: int) -> dict[str, Any]:
    device = _device(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    T = cfg.trainers
    world = T + cfg.receivers
    rdv = Rendezvous("127.0.0.1", port, rank, world, timeout=cfg.timeout)
    trainer = rank < T
    if trainer:
        weights = _fsdp_weights(cfg, device, rank, train_port) if T > 1 else _trainer_weights(cfg, device)
    else:
        weights = _rollout_weights(cfg, device)
    engine = CheckpointEngineRegistry.new(
        cfg.engine, device=device, timeout=cfg.timeout,
        bucket_size=cfg.bucket_mb << 20 if cfg.bucket_mb else None, role="trainer" if trainer else "rollout",
        **({"topology": cfg.topology} if cfg.topology else {}))
    if not trainer:
        engine.set_destinations(weights)
    connect(engine, rdv, T, cfg.receivers)
    source = ModuleSource(weights, dtype=WIRE) if trainer else None
    # every rank plans the floor's buckets from trainer 0's manifest (it names which trainer
    # ranks hold each tensor: the buckets' owners)
    manifest = rdv.all_gather(source.manifest if rank == 0 else None)[0]  # type: ignore[union-attr]
    plan = engine._plan(manifest)  # type: ignore[attr-defined]
    if cfg.engine == "nixl":
        floor = (lambda: raw_nixl(engine, plan)) if trainer else (lambda: None)  # one-sided
        group = None
    elif cfg.engine == "mooncake":
        floor = (lambda: None) if trainer else (lambda: raw_mooncake(engine, plan))  # the readers
        group = None
    else:
        groups = engine._data  # type: ignore[attr-defined]
        group = groups[0] if T == 1 else None  # (the per-tensor baseline: one trainer only)
        floor_slots = [torch.empty(engine.bucket_size, dtype=torch.uint8, device=device) for _ in range(2)]
        floor = lambda: raw_broadcast(engine, plan, floor_slots)  # noqa: E731

    weightbus = _update_fn(engine, source, weights)
    delta_fn, delta_engine, delta_weights = None, None, None
    if cfg.delta is not None:  # a second engine in delta mode, into its own copy on rollouts
        delta_engine = CheckpointEngineRegistry.new(
            cfg.engine, device=device, timeout=cfg.timeout, delta=True,
            role="trainer" if trainer else "rollout",
            bucket_size=cfg.bucket_mb << 20 if cfg.bucket_mb else None,
            **({"topology": cfg.topology} if cfg.topology else {}))
        if not trainer:
            delta_weights = {n: t.clone() for n, t in weights.items()}
            delta_engine.set_destinations(delta_weights)
        connect(delta_engine, rdv, T, cfg.receivers)
        delta_fn = _update_fn(delta_engine, source, delta_weights)

    shard_fn = relay_fn = shard_engine = relay_engine = shards = relayed = None
    sdelta_fn = sdelta_engine = sdelta = None
    if cfg.rollout_tp:  # more engines: each rollout rank a TP rank keeping its rows
        tp_rank = (rank - T) % cfg.rollout_tp

        def sharded_engine(relay: int, delta: bool = False) -> tuple[Any, Any, Any]:
            eng = CheckpointEngineRegistry.new(
                cfg.engine, device=device, timeout=cfg.timeout, role="trainer" if trainer else "rollout",
                bucket_size=cfg.bucket_mb << 20 if cfg.bucket_mb else None, relay=relay, delta=delta)
            dests = None
            if not trainer:
                dests = {n: torch.zeros(_tp_box(s, tp_rank, cfg.rollout_tp).size, dtype=WIRE, device=device)
                         for n, s in cfg.shapes()}
                eng.set_shard_destinations({n: [(_tp_box(s, tp_rank, cfg.rollout_tp), dests[n])]
                                            for n, s in cfg.shapes()})
            connect(eng, rdv, T, cfg.receivers)

            def fn() -> None:
                if trainer:
                    asyncio.run(eng.send_weights(source))
                else:
                    async def drain() -> None:  # (every region lands in place: nothing is yielded)
                        async for _ in eng.receive_weights():
                            pass
                    asyncio.run(drain())
            return eng, dests, fn

        shard_engine, shards, shard_fn = sharded_engine(0)
        if cfg.relay:
            relay_engine, relayed, relay_fn = sharded_engine(cfg.relay)
        if cfg.delta is not None:  # delta mode on the same sharded plan: each rank's own changes
            sdelta_engine, sdelta, sdelta_fn = sharded_engine(0, delta=True)
        # each receiver's bytes (its boxes of every tensor), for the floors: every receiver
        # fed from the trainer (direct), or the first replica's only (relayed)
        counts = [sum(_tp_box(s, r % cfg.rollout_tp, cfg.rollout_tp).numel for _, s in cfg.shapes())
                  * WIRE.itemsize for r in range(cfg.receivers)]
        chunk = shard_engine.bucket_size
        p2p_slots = [torch.empty(chunk, dtype=torch.uint8, device=device)
                     for _ in range(2 if trainer else 2 * T)]  # (a receiver: two per sender in flight)
        sharded_floor = lambda: raw_sends(groups, rank, T, counts, chunk, p2p_slots)  # noqa: E731
        roots = counts[:cfg.rollout_tp] + [0] * (cfg.receivers - cfg.rollout_tp)
        relayed_floor = lambda: raw_sends(groups, rank, T, roots, chunk, p2p_slots)  # noqa: E731

    def naive() -> None:  # a broadcast per tensor (collective engines only)
        works: list[Any] = []
        for t in weights.values():
            buf = t.to(WIRE) if trainer else t
            works.append(comm.broadcast(group, buf, 0))
            if len(works) > 8:  # bounded: each in-flight cast holds its memory
                works.pop(0).wait()
        for w in works:
            w.wait()

    rounds = iter(range(1 << 30))
    if cfg.delta is not None:
        def mutate() -> None:
            if trainer:
                _mutate_fraction(weights, cfg.delta, next(rounds))  # type: ignore[arg-type]
    else:
        def mutate() -> None:
            if trainer:
                _mutate(weights)
    more = {}
    if shard_fn is not None:
        more.update(sharded_floor=sharded_floor, sharded=shard_fn)
    if relay_fn is not None:
        more.update(relayed_floor=relayed_floor, relayed=relay_fn)
    if sdelta_fn is not None:
        more.update(sharded_delta=sdelta_fn)
    times, peak = _measure(cfg, rdv, device, mutate, floor, weightbus, naive if group is not None else None,
                           delta_fn, more)
    if trainer and T > 1:  # the whole tensors, gathered (every trainer takes part), checked on rank 0
        full = {n: t.full_tensor() for n, t in weights.items()}
        check = _checksums(full) if rank == 0 else {}
    else:
        full = weights
        check = _checksums(weights)
    result = {"times": times, "checksums": check, "peak_extra": peak + _engine_bytes(engine),
              "engine_buffers": engine.num_buffers * engine.bucket_size}
    if delta_engine is not None:
        if delta_weights is not None and _checksums(delta_weights) != check:
            result["checksums"] = {"delta mode": "MISMATCH"}
        stats = delta_engine.last_stats
        held = delta_engine._snapshots  # type: ignore[attr-defined]
        # what it holds between updates on the weights' device: the snapshots, the arenas its
        # records are made in, on a GPU the kernels' block tables
        snaps = sum(t.numel() * t.element_size() for t in held.pieces.values()
                    if t.device.type == device.type)
        snaps += held.arenas.nbytes if device.type == "cpu" else \
            sum(a.nbytes for a in held.device_arenas.values()) + held.layouts.nbytes
        result.update(delta_wire=stats.wire_bytes if stats else 0, dense_wire=plan.wire_bytes,
                      delta_full=delta_engine.last_full,
                      delta_extra=int(times.pop("delta_peak", [0])[0]) + snaps + _engine_bytes(delta_engine))
        delta_engine.finalize(destroy_group=True)
    if shard_engine is not None:
        tp = cfg.rollout_tp
        if trainer:  # what each TP rank must hold: its rows of every tensor
            result["shard_sent"] = shard_engine.last_stats.wire_bytes  # type: ignore[union-attr]
            result["shard_checksums"] = [  # type: ignore[arg-type]
                _checksums({n: _tp_box(t.shape, r, tp).of(t) for n, t in full.items()}) for r in range(tp)]
        else:
            stats = shard_engine.last_stats
            result.update(shard_checksums=_checksums(shards), shard_bytes=stats.bytes)  # type: ignore[arg-type,union-attr]
            if relay_engine is not None and _checksums(relayed) != result["shard_checksums"]:  # type: ignore[arg-type]
                result["shard_checksums"] = {"relayed": "MISMATCH"}  # type: ignore[assignment]
        shard_engine.finalize(destroy_group=True)
        if sdelta_engine is not None:
            stats = sdelta_engine.last_stats
            result.update(sharded_delta_wire=stats.wire_bytes if stats else 0,
                          sharded_delta_full=sdelta_engine.last_full)
            if not trainer and _checksums(sdelta) != result["shard_checksums"]:  # type: ignore[arg-type]
                result["shard_checksums"] = {"sharded delta mode": "MISMATCH"}  # type: ignore[assignment]
            if trainer:
                result["sharded_wire"] = shard_engine.last_stats.wire_bytes  # type: ignore[union-attr]
            sdelta_engine.finalize(destroy_group=True)
        if relay_engine is not None:
            result["relay_wire"] = relay_engine.last_stats.wire_bytes if trainer else 0  # type: ignore[union-attr]
            result["sharded_wire"] = shard_engine.last_stats.wire_bytes if trainer else 0  # type: ignore[union-attr]
            relay_engine.finalize(destroy_group=True)
    engine.finalize(destroy_group=True)
    if trainer and T > 1:
        dist.destroy_process_group()
    return result


def _tp_box(shape: tuple[int, ...], r: int, tp: int) -> Box:
    """TP rank ``r``'s part of a tensor in the bench's sharded rows: its rows of a matrix
    (any tensor of 2+ dims), the whole of a vector."""
    return chunk_box(shape, 0, r, tp) if len(shape) >= 2 else Box.whole(shape)


def _colocated_engine(cfg: BenchConfig, device: torch.device, trainer: bool,
                      weights: dict[str, torch.Tensor] | None) -> CheckpointEngine:
    engine = CheckpointEngineRegistry.new(
        "colocated", device=device, timeout=cfg.timeout,
        bucket_size=cfg.bucket_mb << 20 if cfg.bucket_mb else None, role="trainer" if trainer else "rollout")
    if not trainer and weights is not None:  # the ring unpacks into them; -direct writes into them
        engine.set_destinations(weights, direct=cfg.scenario.endswith("-direct"))  # type: ignore[call-arg]
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
    source: Any = ModuleSource(weights, dtype=WIRE) if trainer else None
    if source is not None and cfg.fp8:
        source = QuantizedSource(source, _fp8_formats(cfg))
    biggest = max(t.numel() for t in weights.values())
    scratch = torch.empty(biggest, dtype=WIRE, device=device) if trainer else None
    bulk = _bulk_cast_copy(cfg, device) if trainer else None

    def floor() -> None:  # one bulk cast-copy of the same elements
        if bulk is not None:
            bulk()

    def naive() -> None:  # a cast-copy per tensor
        if trainer:
            for t in weights.values():
                scratch[: t.numel()].copy_(t.view(-1))  # type: ignore[index]

    weightbus = _update_fn(engine, source, weights)

    times, peak = _measure(cfg, rdv, device, lambda: _mutate(weights) if trainer else None,
                           floor, weightbus, None if cfg.fp8 else naive)
    held = _served(cfg, weights) if trainer and cfg.fp8 else weights  # (what the rollout should hold)
    result = {"times": times, "checksums": _checksums(held, wire=not cfg.fp8),
              "peak_extra": peak + _engine_bytes(engine),
              "engine_buffers": engine.num_buffers * engine.bucket_size}
    # the rollout's exported tensors outlive the trainer's hold on them: a process that
    # closes a CUDA IPC mapping after its exporter exited aborts (torch cannot unlink the
    # mapping's reference count), so the rollout exits only after the trainer let go
    rdv.all_gather(None)
    engine.finalize(destroy_group=True)
    rdv.all_gather(None)
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
    total = presets.nbytes(cfg.preset, 2, cfg.layers)
    ag_in = torch.empty(chunk // T, dtype=torch.uint8, device=device) if trainer else None
    ag_out = torch.empty(chunk, dtype=torch.uint8, device=device) if trainer else None

    def floor() -> None:  # all-gather of the same bf16 bytes among the trainers
        if trainer:
            done = 0
            while done < total:
                comm.all_gather_single(ag_out, ag_in)
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
    params = presets.nbytes(cfg.preset, 1, cfg.layers)  # parameter count
    item = TRAINER_DTYPES[cfg.trainer_dtype].itemsize
    biggest = max(_numel(s) for _, s in cfg.shapes()) * 2
    slack = 4 * 2**30 + 4 * biggest + FLOOR_CHUNK * (item + 2)  # buckets, floor buffers, allocator
    need = {"disaggregated": item * params, "colocated": (item + 2) * params,
            "hybrid-fsdp": item * params + 2 * params}[cfg.scenario.removesuffix("-direct")] + slack
    free = torch.cuda.mem_get_info(0)[0]
    if need > free:
        return f"needs ~{need / 2**30:.0f} GiB on one GPU, {free / 2**30:.0f} GiB free"
    return None


def _free_port() -> int:
    """A port for the trainers' own process group (a store bound and released at once)."""
    tmp = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    port = tmp.port
    del tmp
    return port


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Runs one scenario on one preset; returns a row for the table."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (shared hosts)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    if cfg.scenario == "disaggregated":
        res = spawn(_disaggregated, cfg.trainers + cfg.receivers, (cfg, store.port, _free_port()),
                    timeout=cfg.timeout * 3)
        trainer, rollouts = res[0], res[cfg.trainers:]
    elif cfg.scenario in ("colocated", "colocated-direct"):
        res = spawn(_colocated, 2, (cfg, store.port), timeout=cfg.timeout * 3)
        trainer, rollouts = res[0], res[1:]
    elif cfg.scenario in ("hybrid-fsdp", "hybrid-fsdp-direct"):
        res = spawn(_hybrid, 4, (cfg, store.port, _free_port()), timeout=cfg.timeout * 3)
        trainer, rollouts = res[0], res[2:]
    else:
        raise ValueError(f"unknown scenario {cfg.scenario!r}; choose from {', '.join(SCENARIOS)}")
    nbytes = presets.nbytes(cfg.preset, 2, cfg.layers)
    if cfg.fp8:  # (what the rollout holds: one byte an element and the scales, where served)
        fp8 = _fp8_formats(cfg)
        nbytes -= sum(_numel(s) - 4 * _numel(fp8[n].scale_shape(s)) for n, s in cfg.shapes() if n in fp8)
    med = {k: statistics.median(v) for k, v in trainer["times"].items() if v}
    verified = all(r["checksums"] == trainer["checksums"] for r in rollouts)
    row: dict[str, Any] = {
        "scenario": cfg.row_name(), "preset": cfg.label(), "device": _device_name(cfg),
        "trainer_dtype": cfg.trainer_dtype, "trainers": cfg.trainers, "tensors": len(cfg.shapes()),
        "bytes": nbytes,
        "bucket_bytes": trainer["engine_buffers"] // 2, "iters": cfg.iters,
        "floor_s": med["floor"], "weightbus_s": med["weightbus"], "naive_s": med.get("naive"),
        "ratio": med["weightbus"] / med["floor"],
        "naive_ratio": med["naive"] / med["floor"] if "naive" in med else None,
        "floor_gbps": nbytes / med["floor"] / 1e9, "weightbus_gbps": nbytes / med["weightbus"] / 1e9,
        "peak_extra_trainer": trainer["peak_extra"],
        "peak_extra_rollout": max(r["peak_extra"] for r in rollouts),
        "verified": verified, "all_times": trainer["times"],
    }
    if cfg.rollout_tp:
        got = [r["shard_bytes"] for r in rollouts]
        row.update(rollout_tp=cfg.rollout_tp, replicas=cfg.replicas, sharded_s=med["sharded"],
                   shard_bytes=got, sharded_vs_broadcast=med["sharded"] / med["weightbus"],
                   shard_sent=[t["shard_sent"] for t in res[:cfg.trainers]],
                   sharded_floor_s=med["sharded_floor"], sharded_ratio=med["sharded"] / med["sharded_floor"],
                   verified=verified and all(
                       r["shard_checksums"] == trainer["shard_checksums"][i % cfg.rollout_tp]
                       for i, r in enumerate(rollouts)))
        if cfg.relay:
            row.update(relay=cfg.relay, relayed_s=med["relayed"],
                       relayed_vs_sharded=med["relayed"] / med["sharded"],
                       relayed_vs_broadcast=med["relayed"] / med["weightbus"],
                       relayed_floor_s=med["relayed_floor"],
                       relayed_ratio=med["relayed"] / med["relayed_floor"],
                       relay_sent_fraction=trainer["relay_wire"] / max(1, trainer["sharded_wire"]))
    if cfg.delta is not None and cfg.rollout_tp:
        row.update(sharded_delta_s=med["sharded_delta"],
                   sharded_delta_vs_sharded=med["sharded_delta"] / med["sharded"],
                   sharded_delta_wire_fraction=trainer["sharded_delta_wire"]
                   / max(1, trainer["sharded_wire"]),
                   sharded_delta_full=trainer["sharded_delta_full"])
    if cfg.delta is not None:
        row.update(delta_fraction=cfg.delta, delta_s=med["delta"],
                   delta_vs_dense=med["delta"] / med["weightbus"], delta_vs_floor=med["delta"] / med["floor"],
                   delta_wire_fraction=trainer["delta_wire"] / trainer["dense_wire"],
                   delta_full=trainer["delta_full"], delta_extra_trainer=trainer["delta_extra"])
    return row


def _device_name(cfg: BenchConfig) -> str:
    if cfg.gpu:
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return "cpu"


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'scenario':<18} {'preset':<14} {'trn':>4} {'tensors':>7} {'GB':>6} {'floor ms':>9} "
            f"{'naive ms':>9} {'wb ms':>9} {'wb GB/s':>8} {'ratio':>6} {'naive':>6} {'+mem trn':>9} "
            f"{'+mem roll':>9}  check")
    lines = [head]
    for r in rows:
        naive = f"{r['naive_s'] * 1e3:9.1f}" if r.get("naive_s") else f"{'-':>9}"
        nratio = f"{r['naive_ratio']:.2f}x" if r.get("naive_ratio") else "-"
        lines.append(
            f"{r['scenario']:<18} {r['preset']:<14} {r.get('trainer_dtype', 'fp32'):>4} "
            f"{r.get('tensors', 0):>7} {r['bytes'] / 1e9:6.2f} {r['floor_s'] * 1e3:9.1f} "
            f"{naive} {r['weightbus_s'] * 1e3:9.1f} {r['weightbus_gbps']:8.1f} {r['ratio']:5.2f}x "
            f"{nratio:>6} {r['peak_extra_trainer'] / 2**30:8.2f}G {r['peak_extra_rollout'] / 2**30:8.2f}G  "
            f"{'OK' if r['verified'] else 'MISMATCH'}")
        if r.get("sharded_s") is not None:
            tp = r["rollout_tp"]
            reps = r.get("replicas", 1)
            # (one replica of TP ranks: each rank gets 1/tp of the bytes, so <= 1.1/tp of the broadcast)
            target = f" (target <= {1.1 / tp:.2f}x)" if reps == 1 and tp > 1 else ""
            floor = (f"; floor {r['sharded_floor_s'] * 1e3:.1f} ms ({r['sharded_ratio']:.2f}x)"
                     if r.get("sharded_floor_s") else "")
            lines.append(f"{'  sharded TP=' + str(tp) + (f' x{reps}' if reps > 1 else ''):<33} "
                         f"{r['sharded_s'] * 1e3:9.1f} ms = {r['sharded_vs_broadcast']:.2f}x the broadcast "
                         f"row{target}{floor}; received per rank "
                         + ", ".join(f"{b / 1e6:.1f} MB" for b in r["shard_bytes"])
                         + f" of {r['bytes'] / 1e6:.1f} MB")
        if r.get("relayed_s") is not None:
            floor = (f"; floor {r['relayed_floor_s'] * 1e3:.1f} ms ({r['relayed_ratio']:.2f}x)"
                     if r.get("relayed_floor_s") else "")
            lines.append(f"{'  relayed relay=' + str(r['relay']):<33} {r['relayed_s'] * 1e3:9.1f} ms = "
                         f"{r['relayed_vs_sharded']:.2f}x the sharded row, "
                         f"{r.get('relayed_vs_broadcast', 0):.2f}x the broadcast row, "
                         f"{r['replicas']} replicas{floor}; the trainer sent "
                         f"{r['relay_sent_fraction']:.2f}x the sharded row's bytes")
        if r.get("delta_s") is not None:
            lines.append(f"{'  delta ' + format(r['delta_fraction'], '.1%') + ' changed':<33} wire "
                         f"{r['delta_wire_fraction']:6.1%} of dense {r['delta_s'] * 1e3:9.1f} ms = "
                         f"{r['delta_vs_dense']:.2f}x dense, {r['delta_vs_floor']:.2f}x floor, +mem trn "
                         f"{r.get('delta_extra_trainer', 0) / 2**30:.2f}G"
                         + (" (went full)" if r.get("delta_full") else ""))
        if r.get("sharded_delta_s") is not None:
            lines.append(f"{'  sharded delta ' + format(r['delta_fraction'], '.1%'):<33} wire "
                         f"{r['sharded_delta_wire_fraction']:6.1%} of sharded "
                         f"{r['sharded_delta_s'] * 1e3:9.1f} ms = "
                         f"{r['sharded_delta_vs_sharded']:.2f}x the sharded row (target <= 0.5x)"
                         + (" (went full)" if r.get("sharded_delta_full") else ""))
    return "\n".join(lines)


FLOORS = ("floor: colocated = one bulk cast-copy of the same elements (per 2^28); disaggregated = "
          "a raw broadcast of the same bucket bytes; hybrid-fsdp = an all-gather of the same bytes; "
          "naive = per tensor; ratio = weightbus / floor")


def main_bench(configs: list[BenchConfig], json_path: str | None = None, plot_path: str | None = None,
               log: Any = print) -> int:
    """Runs every configuration (each already checked), printing a progress line before
    and a row after each; returns 0 when every row ran and was verified."""
    rows, failed = [], 0
    for i, cfg in enumerate(configs, 1):
        what = f"[{i}/{len(configs)}] {cfg.scenario} {cfg.label()} ({cfg.trainer_dtype} trainer)"
        why = fits(cfg)
        if why:
            log(f"{what}: skipped: {why}")
            failed += 1
            continue
        log(f"{what}: running {cfg.iters} timed iterations ...")
        t0 = time.perf_counter()
        try:
            row = run_bench(cfg)
        except Exception as e:  # noqa: BLE001 - one scenario failing must not hide the others
            log(f"{what}: FAILED after {time.perf_counter() - t0:.0f} s: {str(e)[-2000:]}")
            failed += 1
            continue
        rows.append(row)
        log(f"{what}: done in {time.perf_counter() - t0:.0f} s")
        table = format_table([row]).splitlines()
        log("\n".join(table) if len(rows) == 1 else table[-1])  # (the header above the first row)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(rows, f, indent=1, default=str)
    log("")
    log(format_table(rows))
    log(FLOORS)
    if plot_path and rows:
        with open(plot_path, "w") as f:
            f.write(plot_svg(rows))
        log(f"plot: {plot_path}")
    return 0 if rows and not failed and all(r["verified"] for r in rows) else 1


def plot_svg(rows: list[dict[str, Any]]) -> str:
    """A bar chart (SVG, no plotting library needed): per row, the floor, the naive
    baseline and weightbus in milliseconds, with weightbus's ratio to the floor."""
    bar, gap, left, width = 14, 18, 260, 560
    top = max(max(r["floor_s"], r["weightbus_s"], r.get("naive_s") or 0) for r in rows)
    height = 40 + len(rows) * (3 * bar + gap)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 140}" height="{height}" '
           f'font-family="sans-serif" font-size="12">',
           '<text x="10" y="20" font-weight="bold">weightbus vs its floor (ms, lower is better)</text>']
    colors = {"floor": "#999999", "naive": "#e0a040", "weightbus": "#3070c0"}
    y = 35
    for r in rows:
        out.append(f'<text x="10" y="{y + 1.6 * bar}">{r["scenario"]} {r["preset"]} '
                   f'({r.get("trainer_dtype", "fp32")}): {r["ratio"]:.2f}x</text>')
        for key in ("floor", "naive", "weightbus"):
            v = r.get(f"{key}_s")
            if v:
                w = max(1.0, width * v / top)
                out.append(f'<rect x="{left}" y="{y}" width="{w:.1f}" height="{bar - 2}" '
                           f'fill="{colors[key]}"/>')
                out.append(f'<text x="{left + w + 4:.1f}" y="{y + bar - 4}">{key} {v * 1e3:.1f}</text>')
            y += bar
        y += gap
    out.append("</svg>")
    return "\n".join(out)


__all__ = ["BenchConfig", "SCENARIOS", "format_table", "main_bench", "plot_svg", "run_bench"]
