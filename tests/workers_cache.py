"""Process targets of the cache tests (spawned: importable by path)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import torch
from workers import Mixed

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource
from weightbus.demo import digest


def cache(role: str, backend: str, where: str, **kw):
    opts = {"path": where} if backend == "disk" else {"cache_name": where}
    return CheckpointEngineRegistry.new(backend, timeout=30, **opts, **kw).connect(role)


def digests(model) -> dict[str, str]:
    return {n: digest(t) for n, t in model.state_dict().items()}


def publisher(backend: str, where: str, versions: int, pace: float, done, out) -> None:
    """Publishes ``versions`` versions (real steps between them), never waiting for readers;
    reports each version's digests and how long each publish blocked it."""
    torch.set_num_threads(1)
    engine = cache("trainer", backend, where)
    model = Mixed()
    published, blocked = {}, []
    for v in range(1, versions + 1):
        model.step(v)
        t0 = time.perf_counter()
        asyncio.run(engine.send_weights(ModuleSource(model), version=v))
        blocked.append(time.perf_counter() - t0)
        published[v] = digests(model)
        time.sleep(pace)
    out.put(("publisher", published, blocked))
    done.wait(120)  # readers finish before the owner removes the cache
    engine.finalize(destroy_group=True)


def reader(backend: str, where: str, pace: float, last: int, idx: int, out) -> None:
    """Pulls the newest version between 'batches' (sleeps) until it holds ``last``."""
    torch.set_num_threads(1)
    engine = cache("rollout", backend, where)
    model = Mixed()
    held, seen = None, []
    deadline = time.monotonic() + 90
    while held != last and time.monotonic() < deadline:
        stream = engine.get_weights(newer_than=held)
        if stream.version is not None:
            asyncio.run(ModuleSink(model).load(stream))
            held = engine.version
            assert held == stream.version
            seen.append((held, digests(model)))
        time.sleep(pace)
    out.put((f"reader{idx}", seen, None))


class _Slow:
    """A source that stops (sleeps, or SIGKILLs its own process) at tensor ``at``."""

    def __init__(self, source, at: int, action: str, ready):
        self.manifest, self._source = source.manifest, source
        self.at, self.action, self.ready = at, action, ready

    def __iter__(self):
        for i, item in enumerate(self._source):
            if i == self.at:
                self.ready.set()
                if self.action == "die":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3)
            yield item


def interrupted_publisher(backend: str, where: str, action: str, ready, go, out) -> None:
    """Publishes version 1, then version 2 with a source that stops midway: dies there
    (``die``) or pauses 3 s (``pause``) and completes."""
    torch.set_num_threads(1)
    engine = cache("trainer", backend, where)
    model = Mixed()
    model.step(1)
    asyncio.run(engine.send_weights(ModuleSource(model), version=1))
    out.put(digests(model))
    go.wait(60)  # the parent has it (a process that kills itself may lose what it queued)
    model.step(2)
    asyncio.run(engine.send_weights(_Slow(ModuleSource(model), 3, action, ready), version=2))
    out.put(digests(model))
    engine.finalize(destroy_group=False)  # leaves the cache for the parent to read


def holding_reader(backend: str, where: str, ready) -> None:
    """Opens the newest version and holds it, unread, until it is killed."""
    engine = cache("rollout", backend, where)
    stream = engine.get_weights()
    assert stream.version is not None
    ready.set()
    time.sleep(600)


def relay_worker(rank: int, port: int, path: str):
    """Trainer (rank 0) -> gloo -> a relay (rank 1) that fills a disk cache."""
    from weightbus.engines.cache import CacheRelay, read_version
    from weightbus.runtime.local import Rendezvous, connect
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank == 0 else "rollout", timeout=30)
    connect(engine, rdv, 1, 1)
    model = Mixed()
    out = []
    if rank == 0:
        for v in (1, 2):
            model.step(v)
            asyncio.run(engine.send_weights(ModuleSource(model, dtype=torch.bfloat16), version=v))
            out.append({n: digest(t.to(torch.bfloat16) if t.is_floating_point() else t)
                        for n, t in model.state_dict().items()})
    else:
        relay = CacheRelay(engine, CheckpointEngineRegistry.new("disk", path=path).connect("trainer"))
        for v in (1, 2):
            assert relay.step() == v
            items = read_version(os.path.join(path, f"v{v:020d}.safetensors"))
            out.append({n: digest(t) for n, t in items})
    engine.finalize(destroy_group=True)
    return out
