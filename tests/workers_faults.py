"""Worker bodies for test_faults.py: a trainer lost (SIGKILL or SIGSTOP) at one phase of
an update, and a group that one rank never joins."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import torch
from workers import Mixed, trainer_stream

from weightbus import CheckpointEngineRegistry, Manifest, ModuleSink, ModuleSource, WeightbusError
from weightbus.runtime.local import Rendezvous, connect


def _lose(how: str) -> None:
    os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    time.sleep(3600)  # (a stopped process resumes here only if someone continues it)


class _DiesAfter:
    """A plain (name, tensor) stream that loses its process after ``n`` tensors."""

    def __init__(self, named: dict[str, torch.Tensor], n: int, how: str):
        self.named, self.n, self.how = named, n, how
        self.manifest = Manifest.from_tensors(named.items())  # so the header goes out first

    def __iter__(self):
        for k, item in enumerate(self.named.items()):
            if k == self.n:
                _lose(self.how)
            yield item


class _Drain:
    async def load(self, stream):
        async for _ in stream:
            pass


def _tp_rows(held: dict[str, torch.Tensor], r: int, R: int):
    """Sharded receive: rollout rank ``r`` keeps its rows of every matrix (the rest whole)."""
    from weightbus.packing.shards import chunk_box, tp_placements
    local = {n: torch.zeros(chunk_box(t.shape, 0, r, R).size, dtype=t.dtype) if t.dim() == 2
             else torch.zeros_like(t) for n, t in held.items()}  # (of the wire dtype: no cast on write)
    return tp_placements(local, r, R, split={n: (0, t.shape) for n, t in held.items() if t.dim() == 2})


def peer_lost(rank: int, port: int, backend: str, lost: int, phase: str, how: str, deadline: float,
              out, delta: bool = False, sharded: bool = False, gpu: bool = False) -> None:
    """1 trainer (rank 0), 2 rollouts (ranks 1, 2). After one good update, rank ``lost`` is
    SIGKILLed or SIGSTOPped at ``phase`` of the next; the survivors report what they saw.
    ``delta``: in delta mode, sent in rounds (a rollout lost mid-update: at its second
    bucket's patch). ``sharded``: the rollouts keep their rows of every matrix (sharded
    receive; a rollout lost mid-update: after its first bucket). ``gpu``: every rank's tensors
    and buckets on GPU 0 (colocated: the CUDA IPC ring and its events)."""
    torch.set_num_threads(1)
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    if gpu:
        torch.zeros(1, device=device)  # (CUDA starts before the 2.5 s formation deadline runs)

    def stream(m: Mixed) -> dict[str, torch.Tensor]:
        return {n: t.to(device) for n, t in trainer_stream(m).items()}
    T, R = 1, 2
    if delta:
        os.environ["WEIGHTBUS_DELTA_ROUNDS"] = "4"
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new(backend, bucket_size=1 << 16, timeout=deadline,
                                          role="trainer" if rank == 0 else "rollout", delta=delta,
                                          **({"device": device} if gpu else {}))
    model = Mixed()
    doomed = rank == lost
    if sharded and rank:
        engine.set_shard_destinations(_tp_rows(trainer_stream(model), rank - T, R))
    if doomed and phase == "formation":
        rdv.all_gather(engine.prepare())  # (a trainer's segments exist) and it never joins
        _lose(how)
    res: dict = {"first": None, "error": None, "seconds": None, "version": None}
    t0 = time.monotonic()
    try:
        connect(engine, rdv, T, R)
        held = stream(Mixed())
        if delta:  # (it writes in place: contiguous tensors)
            held = {n: t.contiguous() for n, t in held.items()}
        sink = ModuleSink(held)
        if sharded:  # the rows land in place; the stream yields only what arrives whole
            sink = _Drain()
        if delta and rank:
            engine.set_destinations(held)
        if rank == 0:
            asyncio.run(engine.send_weights(ModuleSource(stream(model))))
        else:
            asyncio.run(sink.load(engine.receive_weights()))
        res["first"] = "ok"
        model.step(2)
        rdv.all_gather(None)
        named = stream(model)
        if doomed and phase == "header":
            _lose(how)
        if doomed and phase == "final-status":
            engine._finish = lambda version, error: _lose(how)  # every byte moved, then lost
        t0 = time.monotonic()
        if rank == 0:
            weights = _DiesAfter(named, 3, how) if doomed and phase == "mid-update" else ModuleSource(named)
            asyncio.run(engine.send_weights(weights))
        elif doomed and phase == "mid-update" and sharded and delta:
            from weightbus.engines.delta import shards as ds
            real_apply = ds._apply

            def patch_then_lose(*a, **k):  # (its first bucket's changes applied)
                got = real_apply(*a, **k)
                _lose(how)
                return got
            ds._apply = patch_then_lose
            asyncio.run(sink.load(engine.receive_weights()))
        elif doomed and phase == "mid-update" and sharded:
            import weightbus.engines.sharded as sh
            real_unpack = sh._Places.unpack

            def unpack_then_lose(self, *a, **k):
                got = real_unpack(self, *a, **k)
                _lose(how)
                return got
            sh._Places.unpack = unpack_then_lose
            asyncio.run(sink.load(engine.receive_weights()))
        elif doomed and phase == "mid-update" and delta:
            from weightbus.engines.delta import receiver as dr
            real, calls = dr._apply, [0]

            def apply_then_lose(*a, **k):
                calls[0] += 1
                if calls[0] == 2:
                    _lose(how)
                return real(*a, **k)
            dr._apply = apply_then_lose
            asyncio.run(sink.load(engine.receive_weights()))
        elif doomed and phase == "mid-update":
            async def consume_then_lose():
                k = 0
                async for _ in engine.receive_weights():
                    k += 1
                    if k == 3:
                        _lose(how)
            asyncio.run(consume_then_lose())
        else:
            asyncio.run(sink.load(engine.receive_weights()))
    except WeightbusError as e:
        res["error"] = str(e)
    res["seconds"] = time.monotonic() - t0
    res["version"] = engine.version
    if phase == "formation":
        res["first"] = "ok"  # there was no first update to have
    out.put((rank, res))


def partial_group(rank: int, port: int, deadline: float, out) -> None:
    """Ranks 0 and 1 of a group of 3; rank 2 never comes."""
    engine = CheckpointEngineRegistry.new("gloo", timeout=deadline,
                                          role="trainer" if rank == 0 else "rollout")
    t0 = time.monotonic()
    try:
        rdv = Rendezvous("127.0.0.1", port, rank, 3, timeout=deadline)
        connect(engine, rdv, 1, 2)
        err = "formed without rank 2"
    except WeightbusError as e:
        err = str(e)
    out.put((rank, err, time.monotonic() - t0))


def group_with_a_failing_rank(rank: int, port: int, deadline: float, out) -> None:
    """Ranks 0 and 1 form a group of 3; rank 2 reaches the rendezvous but cannot make its
    engine (a rollout whose set-up failed): it takes part with its reason instead."""
    t0 = time.monotonic()
    try:
        rdv = Rendezvous("127.0.0.1", port, rank, 3, timeout=deadline)
        if rank == 2:
            rdv.fail("vLLM worker 0: cannot make the engine: out of memory")
        engine = CheckpointEngineRegistry.new("gloo", timeout=deadline,
                                              role="trainer" if rank == 0 else "rollout")
        connect(engine, rdv, 1, 2)
        err = "formed with a failed rank"
    except WeightbusError as e:
        err = str(e)
    out.put((rank, err, time.monotonic() - t0))
