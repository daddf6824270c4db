"""Local processes: spawn workers with a deadline, and exchange small objects among them
through a TCPStore (used to pass engine metadata between prepare and init)."""

from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from weightbus import comm, config
from weightbus.engines.api import CheckpointEngine
from weightbus.errors import WeightbusError, WeightSyncError, as_timedelta
from weightbus.runtime.group import enter_env, process_context, worker_env


class RankFailed:
    """What a rank that cannot take part contributes to a rendezvous instead of its
    object, so that every other rank fails at once with its reason (not at the deadline)."""

    def __init__(self, reason: str):
        self.reason = reason


class Rendezvous:
    """All-gather of picklable objects among ``world`` processes over one TCPStore."""

    def __init__(self, addr: str, port: int, rank: int, world: int, *,
                 timeout: float | None = None, prefix: str = "rdv", store: dist.Store | None = None):
        timeout = config.timeout(timeout)
        self.rank, self.world, self.prefix, self.timeout = rank, world, prefix, timeout
        self.store = store if store is not None else \
            comm.connect_store(addr, port, timeout, f"rendezvous rank {rank} of {world}")
        self._round = 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``; a rank that does not arrive within the deadline is an
        error naming it (not the store's bare timeout)."""
        self._round += 1
        key = f"{self.prefix}/{self._round}"
        self.store.set(f"{key}/{self.rank}", pickle.dumps(obj))
        try:
            self.store.wait([f"{key}/{r}" for r in range(self.world)], as_timedelta(self.timeout))
        except Exception as e:  # noqa: BLE001 - name who is missing
            try:
                missing = [r for r in range(self.world) if not self.store.check([f"{key}/{r}"])]
            except Exception:  # noqa: BLE001 - the store itself is gone
                missing = []
            who = f"ranks {missing} did not arrive" if missing else f"the store failed ({e})"
            raise WeightSyncError(f"rendezvous rank {self.rank} of {self.world} ({self.prefix!r}, round "
                                  f"{self._round}): {who} within {self.timeout:.0f}s") from None
        got = [pickle.loads(self.store.get(f"{key}/{r}")) for r in range(self.world)]
        failed = {r: x.reason for r, x in enumerate(got) if isinstance(x, RankFailed)}
        if failed:
            raise WeightSyncError(f"rendezvous rank {self.rank} of {self.world} ({self.prefix!r}, round "
                                  f"{self._round}): " + "; ".join(f"rank {r} failed: {why}"
                                                                  for r, why in failed.items()))
        return got

    def fail(self, reason: str) -> None:
        """Take part in the next round with ``reason`` instead of an object: every rank
        (this one too) raises, naming this rank and the reason."""
        self.all_gather(RankFailed(reason))


def connect(engine: CheckpointEngine, rdv: Rendezvous, trainer_world_size: int,
            rollout_world_size: int) -> None:
    """prepare -> all-gather metadata -> build_topology -> init_process_group, with the
    rendezvous ranks laid out trainers first, then rollouts."""
    metadata = rdv.all_gather(engine.prepare())
    t_kw, r_kw = type(engine).build_topology(trainer_world_size, rollout_world_size, metadata)
    T = trainer_world_size
    kw, i = (t_kw, rdv.rank) if rdv.rank < T else (r_kw, rdv.rank - T)
    engine.init_process_group(**{k: v[i] for k, v in kw.items()})


def join(engine: CheckpointEngine, *, rank: int, trainer_world_size: int, rollout_world_size: int,
         master_addr: str, master_port: int, serve: bool | None = None,
         timeout: float | None = None) -> Rendezvous:
    """Set up ``engine`` on this rank in one call: the whole prepare -> exchange ->
    build_topology -> init sequence, every rank calling it with its own ``rank``
    (trainers ``0..T-1``, then rollouts ``T..T+R-1``).

    Rank 0 serves the rendezvous store at ``master_port`` (or, under ``torchrun``, every
    rank uses the store torchrun's agent already serves there; ``serve`` overrides);
    the others connect to ``master_addr:master_port``. A rank that cannot reach it fails
    within ``timeout`` (default: the engine's) with an error naming the address. Returns
    the rendezvous (keep it to exchange more small objects)."""
    if not 0 <= rank < trainer_world_size + rollout_world_size:
        raise WeightbusError(f"rank {rank} is outside the {trainer_world_size} trainer + "
                             f"{rollout_world_size} rollout ranks")
    timeout = engine.timeout if timeout is None else config.timeout(timeout)
    if serve is None:  # torchrun's agent serves a store at MASTER_PORT for its workers
        serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    where = f"rank {rank} ({'trainer' if rank < trainer_world_size else 'rollout'})"
    if not serve:
        store = comm.connect_store(master_addr, master_port, timeout, where)
    else:
        try:
            store = dist.TCPStore("0.0.0.0", master_port, None, True, timeout=as_timedelta(timeout),
                                  wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - one line that names the port, not a C++ frame dump
            raise WeightSyncError(f"{where}: cannot serve the rendezvous store on port {master_port} "
                                  f"({type(e).__name__}: {str(e).splitlines()[0]}); is the port in use? "
                                  f"pick another master_port") from None
    rdv = Rendezvous(master_addr, master_port, rank, trainer_world_size + rollout_world_size,
                     prefix="weightbus/join", store=store, timeout=timeout)
    connect(engine, rdv, trainer_world_size, rollout_world_size)
    engine._join_store = store  # type: ignore[attr-defined]  # rank 0 keeps serving it
    return rdv


def _entry(fn: Callable[..., Any], rank: int, args: tuple, out: Any, env: dict[str, str]) -> None:
    # Ctrl-C is the parent's to handle (it ends every worker at once, see spawn); a worker
    # told to end (SIGTERM) unwinds, so that what it made (shared memory) is released
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _unwind)
    enter_env(env)
    try:
        out.put((rank, True, fn(rank, *args)))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        out.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _unwind(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _end(procs: list[Any], within: float = 0.5) -> None:
    """End worker processes: asked to unwind first, killed if they have not within ``within``."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    stop = time.monotonic() + within
    for p in procs:
        p.join(max(0.0, stop - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1)


def _start_deaf(procs: list[Any]) -> None:
    """Start worker processes that ignore Ctrl-C from birth: a signal ignored survives the
    exec, so a Ctrl-C that lands while a spawned worker still imports (before ``_entry``)
    is no traceback of its own; the parent ends the workers (see ``spawn``). (A
    forkserver's workers take the server's signals, not these: torch is imported
    already, so their window is short.)"""
    if threading.current_thread() is not threading.main_thread():
        for p in procs:  # (only the main thread may set handlers; Ctrl-C is the main thread's)
            p.start()
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        for p in procs:
            p.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def spawn(fn: Callable[..., Any], nprocs: int, args: tuple = (), *, timeout: float = 300.0,
          allow_fail: frozenset[int] = frozenset(), grace: float = 15.0) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` fresh processes; return their results by rank.

    Raises :class:`WeightbusError` naming every rank that failed (with its traceback),
    or that was still running after ``timeout`` seconds (it is killed). Ctrl-C (a
    ``KeyboardInterrupt`` here) ends every worker within a second, then goes on. Ranks in
    ``allow_fail`` may fail or die; their entry is then the error text. Once a rank not
    in ``allow_fail`` has failed, the others get ``grace`` seconds to end (they usually
    wait on it: a rendezvous, a collective) before they are killed: the call fails then,
    not at ``timeout``.
    """
    ctx = process_context()
    out = ctx.Queue()
    env = worker_env()
    procs = [ctx.Process(target=_entry, args=(fn, r, args, out, env), daemon=True) for r in range(nprocs)]
    _start_deaf(procs)
    try:
        results, cut_short = _collect(procs, out, timeout, allow_fail, grace)
    except KeyboardInterrupt:
        _end(procs)
        raise
    for r, p in enumerate(procs):
        if r not in results:
            results[r] = (False, f"still running {grace:.0f}s after another rank failed: killed"
                          if cut_short else f"still running after {timeout:.0f}s: killed")
            p.kill()
        p.join(5)
    failed = {r: v for r, (ok, v) in results.items() if not ok and r not in allow_fail}
    if failed:
        raise WeightbusError("worker processes failed:\n" + "\n".join(
            f"--- rank {r}: {v}" for r, v in sorted(failed.items())))
    return [results[r][1] for r in range(nprocs)]


def _collect(procs: list[Any], out: Any, timeout: float, allow_fail: frozenset[int], grace: float
             ) -> tuple[dict[int, tuple[bool, Any]], bool]:
    nprocs = len(procs)
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    cut_short = False  # a rank failed: the rest were given ``grace``
    while len(results) < nprocs and time.monotonic() < deadline:
        if not cut_short and any(not ok and r not in allow_fail for r, (ok, _) in results.items()):
            cut_short, deadline = True, min(deadline, time.monotonic() + grace)
        try:
            rank, ok, value = out.get(timeout=0.2)
            results[rank] = (ok, value)
            continue
        except queue.Empty:
            pass
        exited = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
        if exited:  # gone without a result (killed, os._exit): drain what is in flight first
            time.sleep(0.5)
            while not out.empty():
                rank, ok, value = out.get()
                results[rank] = (ok, value)
            for r in exited:
                results.setdefault(r, (False, f"process exited with code {procs[r].exitcode} "
                                              f"without a result"))
    return results, cut_short
