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


def trainer_lost(rank: int, port: int, backend: str, phase: str, how: str, deadline: float, out) -> None:
    torch.set_num_threads(1)
    T, R = 1, 2
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new(backend, bucket_size=1 << 16, timeout=deadline,
                                          role="trainer" if rank == 0 else "rollout")
    model = Mixed()
    if rank == 0:
        if phase == "formation":
            rdv.all_gather(engine.prepare())  # its segments exist; it dies before joining
            _lose(how)
        connect(engine, rdv, T, R)
        asyncio.run(engine.send_weights(ModuleSource(trainer_stream(model))))
        model.step(2)
        rdv.all_gather(None)
        named = trainer_stream(model)
        if phase == "header":
            _lose(how)
        if phase == "mid-update":
            asyncio.run(engine.send_weights(_DiesAfter(named, 3, how)))
        if phase == "final-status":
            engine._finish = lambda version, error: _lose(how)  # everything sent, then lost
            asyncio.run(engine.send_weights(ModuleSource(named)))
        return
    res: dict = {"first": None, "error": None, "seconds": None, "version": None}
    t0 = time.monotonic()
    try:
        connect(engine, rdv, T, R)
        sink = ModuleSink(trainer_stream(Mixed()))
        asyncio.run(sink.load(engine.receive_weights()))
        res["first"] = "ok"
        rdv.all_gather(None)
        t0 = time.monotonic()
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
