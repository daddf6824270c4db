"""Worker of tests/test_hotpath.py: what one warm update does on each side, counted."""

from __future__ import annotations

import asyncio
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource
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
                  port: int) -> dict[str, int]:
    """Trainer (rank 0) sends a model of ``tensors`` flat bf16 tensors to a rollout (rank 1)
    that loads it with a sink made per update, as users write it; weights change between
    updates. Returns the counts of the third update, and a checksum to compare."""
    trainer = rank == 0
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    n = tensor_bytes // 2
    g = torch.Generator().manual_seed(0)
    name, _, mode = backend.partition("-")  # colocated-direct: the GPU's direct mode
    device = torch.device("cuda", 0) if mode == "direct" else torch.device("cpu")
    weights = {f"layers.{i}.w": (torch.randn(n, generator=g) if trainer else torch.zeros(n)).bfloat16()
               .to(device) for i in range(tensors)}
    engine = CheckpointEngineRegistry.new(name, role="trainer" if trainer else "rollout",
                                          bucket_size=bucket, timeout=60, device=device)
    if not trainer:
        if mode == "direct":
            engine.set_destinations(weights, direct=True)
        else:
            engine.set_destinations(weights)
    connect(engine, rdv, 1, 1)
    source = ModuleSource(weights) if trainer else None

    def update() -> None:
        if trainer:
            asyncio.run(engine.send_weights(source))
        else:
            asyncio.run(ModuleSink(weights).load(engine.receive_weights()))

    out: dict[str, int] = {}
    for step in range(3):
        if trainer:
            with torch.no_grad():
                for t in weights.values():
                    t.add_(1.0)
        rdv.all_gather(None)
        if step:  # (the first count also pays for what counting itself imports)
            out = counted(update)
        else:
            update()
    out["buckets"] = engine.last_stats.buckets  # type: ignore[union-attr]
    flat = torch.cat([t.view(torch.int16).to(torch.int64).cpu() for t in weights.values()])
    out["sum"] = int(flat.sum())
    engine.finalize(destroy_group=True)
    return out
