"""Process targets of the cache tests (spawned: importable by path)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import torch
from workers import Mixed

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource
from weightbus.tools.demo import digest


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


def interrupted_publisher(backend: str, where: str, action: str, ready, go, out, job=None) -> None:
    """Publishes version 1, then version 2 with a source that stops midway: dies there
    (``die``) or pauses 3 s (``pause``) and completes. ``job``: the publisher's job name."""
    torch.set_num_threads(1)
    engine = cache("trainer", backend, where, **({"job": job} if job else {}))
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


# --- faults (tests/test_faults_cache.py): forked, so no process pays torch's import again ----

def _private_tmpfs(targets: list[str], size: int) -> str | None:
    """Mount a ``size``-byte tmpfs on each of ``targets``, seen by this process and its
    children only (a mount namespace of their own: it goes when they do). This process
    must be single-threaded (a forked one is). None, or why it cannot."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    newns, newuser, rec, private = 0x00020000, 0x10000000, 1 << 14, 1 << 18
    uid, gid = os.geteuid(), os.getegid()
    if libc.unshare(newns) != 0:  # root with CAP_SYS_ADMIN; else a user namespace too
        if libc.unshare(newns | newuser) != 0:
            return f"cannot make a mount namespace: {os.strerror(ctypes.get_errno())}"
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    if libc.mount(b"none", b"/", None, rec | private, None) != 0:  # nothing leaks to the host
        return f"cannot make / private: {os.strerror(ctypes.get_errno())}"
    for t in targets:
        os.makedirs(t, exist_ok=True)
        if libc.mount(b"tmpfs", t.encode(), b"tmpfs", 0, f"size={size}".encode()) != 0:
            return f"cannot mount a tmpfs on {t}: {os.strerror(ctypes.get_errno())}"
    return None


def _full_publisher(backend: str, where: str, limit: int | None, conn) -> None:
    """Publishes version 1, then version 2 into a full file system (``limit``: under a
    file-size limit instead); reports what publishing 2 raised, then (with a limit, once
    told) lifts it and publishes 2 again."""
    import resource
    torch.set_num_threads(1)
    engine = cache("trainer", backend, where, keep=2)
    model = Mixed()
    model.step(1)
    asyncio.run(engine.send_weights(ModuleSource(model), version=1))
    conn.send(digests(model))
    model.step(2)
    if limit is not None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        asyncio.run(engine.send_weights(ModuleSource(model), version=2))
        conn.send(("published", None, sorted(os.listdir(engine.root))))
    except Exception as e:  # noqa: BLE001 - reported to the test
        conn.send((type(e).__name__, str(e), sorted(os.listdir(engine.root))))
    if limit is not None and conn.recv() == "again":
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        asyncio.run(engine.send_weights(ModuleSource(model), version=2))
        conn.send(digests(model))


def full_publish(backend: str, where: str, mode: str, conn) -> None:
    """A publisher (a child) meets a full file system: ``tmpfs`` (a 1 MiB tmpfs on the
    cache's directory, or on /dev/shm for ``shm``: version 1 fits, 2 does not) or
    ``fsize`` (a file-size limit). Then this process, a reader, pulls the newest version.
    Sends the test a dict of what happened."""
    import multiprocessing as mp
    import shutil
    torch.set_num_threads(1)
    out: dict = {}
    root = where if backend == "disk" else f"/dev/shm/wbcache_{where}"
    try:
        if mode == "tmpfs":
            why = _private_tmpfs([where if backend == "disk" else "/dev/shm"], 1 << 20)
            if why:
                conn.send({"skip": why})
                return
        ctx = mp.get_context("fork")
        mine, theirs = ctx.Pipe()
        p = ctx.Process(target=_full_publisher,
                        args=(backend, where, 64 << 10 if mode == "fsize" else None, theirs))
        p.start()
        theirs.close()
        out["v1"] = mine.recv()
        try:
            out["outcome"] = mine.recv()
        except EOFError:  # it died
            p.join(60)
        out["files"] = sorted(os.listdir(root))
        reader = cache("rollout", backend, where)
        model = Mixed()
        stream = reader.get_weights()
        asyncio.run(ModuleSink(model).load(stream))
        out["read"] = (stream.version, digests(model))
        if mode == "fsize" and p.is_alive():  # room again: the same engine publishes 2
            mine.send("again")
            out["v2"] = mine.recv()
            stream = reader.get_weights(newer_than=1)
            asyncio.run(ModuleSink(model).load(stream))
            out["read2"] = (stream.version, digests(model))
        p.join(60)
        out["exitcode"] = p.exitcode
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        if backend == "shm":
            shutil.rmtree(root, ignore_errors=True)
        conn.send(out)


def pull(backend: str, where: str, newer_than, conn) -> None:
    """One pull by a reader of its own (a process): (version, digests) or the error."""
    torch.set_num_threads(1)
    try:
        reader = cache("rollout", backend, where)
        stream = reader.get_weights(newer_than=newer_than)
        model = Mixed()
        asyncio.run(ModuleSink(model).load(stream))
        conn.send((stream.version, digests(model)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        conn.send((None, f"{type(e).__name__}: {e}"))


class _Raising:
    """A source that raises midway (a trainer-side failure while publishing)."""

    def __init__(self, source, after: int):
        self.manifest, self._source, self._after = source.manifest, source, after

    def __iter__(self):
        for i, item in enumerate(self._source):
            if i == self._after:
                raise RuntimeError("the publisher failed midway")
            yield item
