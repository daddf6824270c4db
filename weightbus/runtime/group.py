"""The ``WorkerGroup`` protocol the manager drives, and its local-process implementation.

A worker group is N ranks of one user class (trainer ranks, or the ranks of one rollout
replica). The manager only ever: starts a method on every rank with per-rank arguments,
then collects the results under a deadline. Failures come back as :class:`WorkerError`
naming the group, the rank, and whether the rank raised, died or missed the deadline.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import os
import time
import traceback
from collections.abc import Sequence
from multiprocessing import connection
from typing import Any, Protocol, runtime_checkable

import torch.multiprocessing as mp

from weightbus import config
from weightbus.errors import WeightbusError


class WorkerError(WeightbusError):
    """One or more ranks of a group failed a call: ``failures`` maps rank -> reason."""

    def __init__(self, group: str, method: str, failures: dict[int, str], kinds: dict[int, str]):
        self.group, self.method, self.failures, self.kinds = group, method, failures, kinds
        super().__init__("; ".join(f"{group} rank {r} {kinds[r]} in {method}(): {why}"
                                   for r, why in sorted(failures.items())))


class Pending(Protocol):
    def result(self, timeout: float) -> list[Any]:
        """Results by rank; raises WorkerError (after at most ``timeout`` seconds)."""
        ...


@runtime_checkable
class WorkerGroup(Protocol):
    """What the manager needs of a group of workers."""

    name: str

    @property
    def size(self) -> int: ...

    def submit(self, method: str, args: Sequence[tuple] | None = None,
               kwargs: Sequence[dict] | None = None) -> Pending:
        """Start ``method`` on every rank (per-rank args/kwargs, or none)."""
        ...

    def shutdown(self) -> None: ...


def call(group: WorkerGroup, method: str, *args: Any, timeout: float, **kwargs: Any) -> list[Any]:
    """The same call on every rank, waited for."""
    return group.submit(method, [args] * group.size, [kwargs] * group.size).result(timeout)


# ------------------------------------------------------------------ local processes

#: what a forkserver imports once, before it forks any worker
_PRELOAD = ["torch", "torch.distributed", "weightbus.engines", "weightbus.runtime.local"]


def process_context() -> Any:
    """The multiprocessing context local workers start in (``WEIGHTBUS_START_METHOD``):
    ``spawn`` (a fresh interpreter, which imports torch: ~1 s of CPU a worker), or
    ``forkserver`` (forked from one server process that imported torch and weightbus
    once; never ``fork``: a parent's threads and CUDA state do not survive it). A
    forkserver's workers get the parent's environment as it is at each start
    (:func:`worker_env`), but the modules it preloaded read theirs when it started."""
    method = config.start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a worker runs with: this process's now, with ``extra`` on top."""
    return {**os.environ, **(extra or {})}


def enter_env(env: dict[str, str]) -> None:
    """In a worker, first thing: take ``env`` (:func:`worker_env`) as its environment."""
    if env != os.environ:
        os.environ.clear()
        os.environ.update(env)


def _serve(cls: type, rank: int, world: int, init_args: tuple, init_kwargs: dict, conn: Any,
           env: dict[str, str]) -> None:
    """A worker process: build the user object, then run calls until told to stop.
    Coroutine methods run to completion on a private event loop."""
    enter_env(env)
    try:
        obj = cls(rank, world, *init_args, **init_kwargs)
        conn.send((0, True, None))
    except BaseException as e:  # noqa: BLE001
        conn.send((0, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    loop = asyncio.new_event_loop()
    while True:
        try:
            call_id, method, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        if method is None:
            conn.send((call_id, True, None))
            return
        try:
            out = getattr(obj, method)(*args, **kwargs)
            if inspect.isawaitable(out):
                out = loop.run_until_complete(out)
            conn.send((call_id, True, out))
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            conn.send((call_id, False, f"{type(e).__name__}: {e}"))


class _LocalPending:
    def __init__(self, group: LocalWorkerGroup, method: str, ids: list[int]):
        self.group, self.method, self.ids = group, method, ids

    def result(self, timeout: float) -> list[Any]:
        return self.group._collect(self.method, self.ids, timeout)


_named: dict[str, int] = {}


def default_name(cls: type, size: int) -> str:
    """A group name that no other group made in this process has (``Rolloutx2``, then
    ``Rolloutx2#2``...): errors, ``versions()`` and ``remove_replicas`` tell replicas
    apart by name."""
    base = f"{cls.__name__}x{size}"
    _named[base] = _named.get(base, 0) + 1
    return base if _named[base] == 1 else f"{base}#{_named[base]}"


class LocalWorkerGroup:
    """``size`` processes on this host, rank r running ``cls(r, size, *args, **kwargs)``,
    with this process's environment and ``env`` on top of it.

    Calls to one rank run one at a time in its main thread (a worker that must keep
    generating during calls runs its generation in a thread of its own). Workers start
    as :func:`process_context` says.
    """

    def __init__(self, cls: type, size: int, *args: Any, name: str | None = None,
                 start_timeout: float = 120.0, env: dict[str, str] | None = None, **kwargs: Any):
        self.name = name or default_name(cls, size)
        ctx = process_context()
        child_env = worker_env(env)
        self._conns, self._procs = [], []
        self._ids = itertools.count(1)
        self._stash: list[dict[int, tuple[bool, Any]]] = [{} for _ in range(size)]
        for r in range(size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(cls, r, size, args, kwargs, child, child_env), daemon=True,
                            name=f"{self.name}-{r}")
            p.start()
            self._conns.append(parent)
            self._procs.append(p)
        try:
            self._collect("__init__", [0] * size, start_timeout)
        except BaseException:
            self.shutdown(timeout=2)  # no half-started group left behind
            raise

    @property
    def size(self) -> int:
        return len(self._procs)

    def pids(self) -> list[int | None]:
        return [p.pid for p in self._procs]

    def alive(self) -> list[bool]:
        return [p.is_alive() for p in self._procs]

    def submit(self, method: str, args: Sequence[tuple] | None = None,
               kwargs: Sequence[dict] | None = None) -> Pending:
        ids = []
        for r, conn in enumerate(self._conns):
            i = next(self._ids)
            try:
                conn.send((i, method, tuple(args[r]) if args else (), dict(kwargs[r]) if kwargs else {}))
            except (BrokenPipeError, OSError):
                self._stash[r][i] = (False, "__dead__")
            ids.append(i)
        return _LocalPending(self, method, ids)

    def _collect(self, method: str, ids: list[int], timeout: float) -> list[Any]:
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        kinds: dict[int, str] = {}
        waiting = set(range(self.size))
        while waiting:
            for r in list(waiting):
                got = self._take(r, ids[r])
                if got is None:
                    continue
                ok, value = got
                waiting.discard(r)
                if ok:
                    results[r] = value
                elif value == "__dead__":
                    failures[r], kinds[r] = f"process exited (code {self._procs[r].exitcode})", "died"
                else:
                    failures[r], kinds[r] = value, "raised"
            if not waiting:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                for r in waiting:
                    failures[r], kinds[r] = f"no answer within {timeout:.0f}s", "timed out"
                break
            connection.wait([self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting],
                               timeout=min(left, 1.0))
        if failures:
            raise WorkerError(self.name, method, failures, kinds)
        return [results[r] for r in range(self.size)]

    def _take(self, r: int, call_id: int) -> tuple[bool, Any] | None:
        stash = self._stash[r]
        conn = self._conns[r]
        try:
            while call_id not in stash and conn.poll():
                i, ok, value = conn.recv()
                stash[i] = (ok, value)
        except (EOFError, OSError):
            stash.setdefault(call_id, (False, "__dead__"))
        if call_id in stash:
            return stash.pop(call_id)
        if not self._procs[r].is_alive():
            time.sleep(0.05)  # a result written just before exiting may still be in the pipe
            try:
                while conn.poll():
                    i, ok, value = conn.recv()
                    stash[i] = (ok, value)
            except (EOFError, OSError):
                pass
            return stash.pop(call_id, (False, "__dead__"))
        return None

    def kill(self, rank: int) -> None:
        """Kill one rank's process (tests of failure handling)."""
        self._procs[rank].kill()

    def shutdown(self, timeout: float = 10.0) -> None:
        for r, conn in enumerate(self._conns):
            if self._procs[r].is_alive():
                try:
                    conn.send((next(self._ids), None, (), {}))
                except (BrokenPipeError, OSError):
                    pass
        deadline = time.monotonic() + timeout
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1)
