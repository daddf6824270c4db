"""Worker bodies for tests/test_trust.py (spawned processes): a source built once while the
user moves the memory of its tensors between updates."""

from __future__ import annotations

import asyncio

import torch
from torch import nn
from workers import Mixed, _receive, _send

from weightbus import CheckpointEngineRegistry, ModuleSource
from weightbus.errors import WeightbusError
from weightbus.runtime.local import Rendezvous, connect
from weightbus.tools.demo import digest


def _move(model: Mixed, how: str, k: int) -> None:
    """Change the weights the way a user's training loop may: in place, or by giving a
    tensor new memory (what a source built once must follow)."""
    g = torch.Generator().manual_seed(100 + k)
    if how == "step":  # in place (an optimizer)
        model.step(k)
        return
    with torch.no_grad():
        if how == "data":  # p.data = new tensor (some optimizers, FSDP's resharding)
            model.proj.weight.data = torch.randn(model.proj.weight.shape, generator=g)
            model.steps.data = model.steps + 7  # a buffer too
            if hasattr(model, "extra"):  # one of many
                model.extra[k * 37 % len(model.extra)].data = torch.randn(3, generator=g)
        elif how == "assign":  # load_state_dict(..., assign=True): new Parameter objects
            sd = {n: (t * 2 if t.is_floating_point() else t).clone() for n, t in model.state_dict().items()}
            model.load_state_dict(sd, assign=True)
        elif how == "setattr":  # a new nn.Parameter set on the module
            model.proj.bias = nn.Parameter(torch.randn(37, generator=g))
        elif how == "dtype":  # model.to(float64): every float parameter re-allocated in another dtype
            model.to(torch.float64)
        elif how == "shape":  # a resized parameter (a grown vocabulary)
            model.proj.bias = nn.Parameter(torch.zeros(38))
        elif how == "remove":
            del model.proj.bias
            model.proj.register_parameter("bias", None)


def source_follows(rank: int, port: int, moves: list[str], dtype: str | None, many: int = 0):
    """Trainer (rank 0) builds ``ModuleSource(model)`` once and sends after each move; the
    rollout (rank 1) receives every update. Returns, per update, the trainer's digests of
    what it meant to send (or its error) and what the rollout received (or its error).
    ``many``: that many small parameters more, so the source's pointer pass is the native
    one (weightbus.packing.native.data_ptrs), built before the first update."""
    torch.set_num_threads(1)
    if many:
        from weightbus.packing import native
        assert many >= native.NATIVE_POINTERS_MIN and native.pointer_library(wait=True) is not None
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", bucket_size=1 << 14, timeout=30,
                                          role="trainer" if rank == 0 else "rollout")
    connect(engine, rdv, 1, 1)
    model = Mixed()
    if many:
        model.extra = nn.ParameterList([nn.Parameter(torch.full((3,), float(i))) for i in range(many)])
    wire = getattr(torch, dtype) if dtype else None
    source = ModuleSource(model, dtype=wire)
    out = []
    for k, how in enumerate(moves, start=1):
        if rank == 0:
            _move(model, how, k)
            try:
                _send(engine, source, version=k)
                sd = model.state_dict()
                out.append({"ok": {n: digest(t.to(wire) if wire and t.is_floating_point() else t)
                                   for n, t in sd.items()}})
            except WeightbusError as e:
                out.append({"error": str(e)})
        else:
            try:
                out.append({"ok": _receive(engine), "version": engine.version})
            except WeightbusError as e:
                out.append({"error": str(e)})
    engine.finalize(destroy_group=True)
    return out


def sharded_destinations_checked(rank: int, port: int, change: str):
    """One trainer, two TP rollout ranks with fixed placements (tests/workers_shards.py's
    block). Update 1 lands; then rollout rank 1 changes one destination (``change``) and
    update 2 must fail on every rank before any byte is written (rank 0's destinations
    untouched too); rank 1 puts it right and update 3 lands bitwise."""
    from workers_shards import expected, placements, rollout_params, weights
    torch.set_num_threads(1)
    T, R = 1, 2
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    trainer = rank < T
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if trainer else "rollout",
                                          bucket_size=1 << 10, timeout=30)
    r = rank - T
    params = None
    if not trainer:
        params = rollout_params(r, R)
        places = placements(params, r, R)
        if change == "unknown" and r == 1:
            places["bogus.weight"] = [(next(iter(places["norm.weight"]))[0], torch.zeros(8))]
        engine.set_shard_destinations(places)
    connect(engine, rdv, T, R)
    out = []
    for step in (1, 2, 3):
        if not trainer and r == 1 and step == 2:
            p = params["up.weight"]
            if change == "dtype":
                p.data = p.data.double()
            elif change == "larger":
                p.data = torch.zeros(p.shape[0] + 2, p.shape[1])
            elif change == "smaller":
                p.data = torch.zeros(p.shape[0] - 1, p.shape[1])
            elif change == "moved":  # new memory of the same shape: followed, not refused
                p.data = torch.full_like(p, float("nan"))
        if not trainer and r == 1 and step == 3 and change in ("dtype", "larger", "smaller"):
            params["up.weight"].data = torch.zeros(expected(1, r, R)["up.weight"].shape)
        before = {n: t.clone() for n, t in params.items()} if params is not None else None
        try:
            if trainer:
                asyncio.run(engine.send_weights(ModuleSource(weights(step)), version=step))
                out.append({"ok": True})
            else:
                async def take():
                    return {n: t.clone() async for n, t in engine.receive_weights()}
                asyncio.run(take())
                want = expected(step, r, R)
                wrong = [n for n, t in params.items() if not torch.equal(t, want[n])]
                out.append({"ok": True, "wrong": wrong})
        except WeightbusError as e:
            same = None if params is None else [n for n, t in params.items()
                                                if t.shape == before[n].shape and not torch.equal(
                                                    t.nan_to_num(7.0), before[n].nan_to_num(7.0))]
            out.append({"error": str(e), "written": same})
    engine.finalize(destroy_group=True)
    return out


def rollback(rank: int, port: int):
    """Versions that go down: refused unless meant (``rollback=True``), by the trainer that
    sent the higher one, and by a rollout that serves it when a restarted trainer (which
    remembers nothing) sends an older one."""
    torch.set_num_threads(1)
    role = "trainer" if rank == 0 else "rollout"

    def formed(prefix: str, engine=None):
        engine = engine or CheckpointEngineRegistry.new("gloo", bucket_size=1 << 14, timeout=30, role=role)
        connect(engine, Rendezvous("127.0.0.1", port, rank, 2, timeout=60, prefix=prefix), 1, 1)
        return engine

    engine = formed("first")
    model = Mixed()
    out = []

    def update(version, rollback=False, step=None):
        try:
            if rank == 0:
                if step:
                    model.step(step)
                asyncio.run(engine.send_weights(ModuleSource(model), version=version, rollback=rollback))
                out.append({"ok": version})
            else:
                got = _receive(engine)
                out.append({"ok": engine.version, "digest": sorted(got.items())})
        except WeightbusError as e:
            out.append({"error": str(e), "version": engine.version})

    update(5, step=1)
    update(3, step=2)                 # lower, not meant: refused at the trainer, heard by the rollout
    update(3, rollback=True)          # meant: lands
    if rank == 0:                     # a restarted trainer: a new engine, no memory of version 3
        engine.finalize(destroy_group=True)
        engine = formed("second")
    else:                             # the rollout stays, serving version 3
        engine.finalize(destroy_group=True)
        engine = formed("second", engine)
    update(2, step=3)                 # lower than what the rollout serves: refused there, everywhere
    update(4)
    engine.finalize(destroy_group=True)
    return out
