"""Worker of tests/test_hotpath.py: what one warm update does on each side, counted."""

from __future__ import annotations

import asyncio
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource
from weightbus.packing import native
from weightbus.packing.shards import chunk_box, tp_placements
from weightbus.runtime.local import Rendezvous, connect


class _Ops(TorchDispatchMode):
    """Counts the torch operators dispatched (each copy, cast or view is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.n += 1
        return func(*args, **(kwargs or {}))


def counted(fn) -> dict[str, int]:  # noqa: ANN001
    """Run ``fn`` and count what it does in Python: lines executed and functions called (a
    Python loop over tensors shows as lines per tensor, a C-level pass as one call), and
    the torch operators it dispatches."""
    lines = calls = 0

    def trace(frame, event, arg):  # noqa: ANN001
        nonlocal lines
        if event == "line":
            lines += 1
        return trace

    def profile(frame, event, arg):  # noqa: ANN001
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    ops = _Ops()
    sys.settrace(trace)
    sys.setprofile(profile)
    try:
        with ops:
            fn()
    finally:
        sys.settrace(None)
        sys.setprofile(None)
    return {"lines": lines, "calls": calls, "ops": ops.n}


def update_counts(rank: int, backend: str, tensors: int, tensor_bytes: int, bucket: int,
                  port: int, fsdp_port: int = 0) -> dict[str, int]:
    """Trainer (rank 0) sends a model of ``tensors`` flat bf16 tensors to a rollout (rank 1)
    that loads it with a sink made per update, as users write it; weights change between
    updates. ``gloo-sharded``: to two rollout ranks (1, 2) of one TP=2 replica, each
    receiving only its half of every tensor into its own (sharded receive).
    ``gloo-fsdp``: two trainer ranks (0, 1) holding the model as FSDP2 does (each its rows
    of every tensor, a gloo mesh at ``fsdp_port``) to two TP ranks (2, 3), each trainer
    sending its own rows. Returns the counts of the third update, and a checksum of what
    this rank holds to compare."""
    name, _, mode = backend.partition("-")  # colocated-direct: the GPU's direct mode
    T = 2 if mode == "fsdp" else 1
    trainer = rank < T
    native.pointer_library(wait=True)  # (counted as it runs once built: not while it builds)
    tp = 2 if mode in ("sharded", "fsdp") else 1
    rdv = Rendezvous("127.0.0.1", port, rank, T + tp, timeout=60)
    n = tensor_bytes // 2
    g = torch.Generator().manual_seed(0)
    device = torch.device("cuda", 0) if mode == "direct" else torch.device("cpu")
    size = n if trainer else chunk_box((n,), 0, rank - T, tp).size[0]  # (uneven: torch.chunk's split)
    weights = {f"layers.{i}.w": (torch.randn(size, generator=g) if trainer else torch.zeros(size)).bfloat16()
               .to(device) for i in range(tensors)}
    if trainer and mode == "fsdp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{fsdp_port}", rank=rank, world_size=T)
        mesh = init_device_mesh("cpu", (T,))
        weights = {k: distribute_tensor(t, mesh, [Shard(0)]) for k, t in weights.items()}
    engine = CheckpointEngineRegistry.new(name, role="trainer" if trainer else "rollout",
                                          bucket_size=bucket, timeout=60, device=device)
    if not trainer:
        if mode == "direct":
            engine.set_destinations(weights, direct=True)
        elif mode in ("sharded", "fsdp"):
            engine.set_shard_destinations(tp_placements(weights, rank - T, tp,
                                                        split={k: (0, (n,)) for k in weights}))
        else:
            engine.set_destinations(weights)
    connect(engine, rdv, T, tp)
    source = ModuleSource(weights) if trainer else None

    async def placed() -> None:  # (sharded: every region is written where it lands, none yielded)
        async for name, _ in engine.receive_weights():
            raise AssertionError(f"{name} arrived whole")

    def update() -> None:
        if trainer:
            asyncio.run(engine.send_weights(source))
        elif mode in ("sharded", "fsdp"):
            asyncio.run(placed())
        else:
            asyncio.run(ModuleSink(weights).load(engine.receive_weights()))

    out: dict[str, int] = {}
    for step in range(3):
        if trainer:
            with torch.no_grad():
                for t in weights.values():
                    (t.to_local() if mode == "fsdp" else t).add_(1.0)
        rdv.all_gather(None)
        if step:  # (the first count also pays for what counting itself imports)
            out = counted(update)
        else:
            update()
    out["buckets"] = engine.last_stats.buckets  # type: ignore[union-attr]
    held = [t.to_local() if mode == "fsdp" and trainer else t for t in weights.values()]
    flat = torch.cat([t.view(torch.int16).to(torch.int64).cpu() for t in held])
    out["sum"] = int(flat.sum())
    out["trainer"] = trainer
    engine.finalize(destroy_group=True)
    if trainer and mode == "fsdp":
        torch.distributed.destroy_process_group()
    return out


def gc_states(rank: int, port: int, delta: bool) -> dict:
    """One trainer, one rollout over gloo, three updates: whether Python's collector ran
    while the trainer's source was read (it must not: the send pauses it), while the
    rollout's consumer held each tensor (it must: a receive pauses it only while it works
    itself), and after each update on both sides (on, as before it). Before the third the
    trainer turns the collector off itself: it stays off. ``delta``: delta mode (the
    receive writes in place and hands nothing to the consumer)."""
    import gc

    from weightbus.engines.delta.encoding import _bits
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank == 0 else "rollout",
                                          bucket_size=1 << 16, timeout=30, delta=delta)
    weights = {f"w{i}": torch.full((64,), float(i)).bfloat16() for i in range(200)}
    if rank == 1 and delta:
        engine.set_destinations({n: t.clone() for n, t in weights.items()})
    connect(engine, rdv, 1, 1)
    seen: list[bool] = []
    after: list[bool] = []
    for k in range(3):
        for t in weights.values():
            _bits(t)[k % 64] += 1
        if k == 2 and rank == 0:
            gc.disable()
        rdv.all_gather(None)
        if rank == 0:
            def source():
                for n, t in weights.items():
                    seen.append(gc.isenabled())
                    yield n, t
            asyncio.run(engine.send_weights(source(), version=k + 1))
        else:
            async def take() -> None:
                async for _, _t in engine.receive_weights():
                    seen.append(gc.isenabled())
            asyncio.run(take())
        after.append(gc.isenabled())
    engine.finalize(destroy_group=True)
    return {"seen": seen, "after": after}
