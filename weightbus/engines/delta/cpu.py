"""Delta mode's CPU kernels (``cpu.c``): the trainer's diff and the receiver's apply in
one pass over memory each, where torch's own ops take ~10 passes and run their
``nonzero``/masked ops far below memory speed. Measured on the 0.6b preset (1.2 GB of bf16,
2 % changed) on one core of this 2-core host: the diff took 1.25 s in torch ops and ~0.2 s
here (~0.11 s of it reading the weights and the snapshot); the apply 0.39 s and ~0.13 s.
Calls run on a few threads (:class:`Jobs`).

Built on first use by :mod:`weightbus.packing.native` (the system's C compiler, cached, loaded with
ctypes, which lets go of the GIL during a call). Where no compiler works, or with
``WEIGHTBUS_DELTA_KERNELS=0``, delta mode uses its torch path: the same records, bit for bit
(tests/test_delta.py checks both), only slower. GPUs have their own (:mod:`.gpu`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from weightbus import config
from weightbus.packing import native

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu.c")
_lib: ctypes.CDLL | None = None
_tried = False
_lock = threading.Lock()
_i64, _p = ctypes.c_int64, ctypes.c_void_p


def _declare(so: ctypes.CDLL) -> None:
    so.wb_diff_many.argtypes = [_i64, _p, _p, _i64, _p]
    so.wb_diff_many.restype = _i64
    so.wb_apply_many.argtypes = [_i64, _p, _p]
    so.wb_apply_many.restype = None


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, or no compiler: the torch path is used)."""
    global _lib, _tried
    if not _tried:
        if config.flag("WEIGHTBUS_DELTA_KERNELS", True):
            _lib = native.load(_SOURCE, _declare, "delta mode's CPU kernels")
        _tried = True
    return _lib


def usable(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels, where every tensor is a contiguous host tensor (else None)."""
    lib = _lib if _tried else library()
    if lib is None:
        return None
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
    return lib


class Arena:
    """Room for one update's encoded records, kept from update to update: fresh host memory
    is paged in on first touch, which would cost more than the diff (~0.3 s per GB here).
    On ``device`` where given (the GPU path's records, asked for exactly)."""

    def __init__(self, chunk: int = 64 << 20, device: torch.device | None = None) -> None:
        self._chunk, self._device = chunk, device
        self._chunks: list[torch.Tensor] = []
        self._at = 0  # the chunk in use
        self._used = 0  # its bytes taken
        self._taken = 0  # bytes taken since the last reset, in every chunk
        self._widest = 0  # the most bytes one room() asked for since then

    def reset(self) -> None:
        """A new update (or round): every record of the last one has been sent. On a
        device, where the chunks hold half as much again as the last one asked for, they
        become one, room for what it took, a quarter more and its widest ask: chunks made to
        measure for one update's records (a GPU group's, exactly), which the next update's
        do not fit, would pile up (8b, 2 % changed: 2.3 GiB of chunks after four updates for
        0.9 GiB of records). Host calls ask for less than a chunk (``delta._BATCH``), so
        host chunks are all of one size and stay (fresh host memory costs page faults)."""
        asked = self._taken + self._widest
        wasteful = len(self._chunks) > 1 and self.nbytes > max(self._chunk, asked * 3 // 2)
        if self._device is not None and wasteful:
            size = max(self._chunk, asked + self._taken // 4 + 8)
            self._chunks = []  # (freed first: the one chunk may take their memory)
            self._chunks = [torch.empty(size, dtype=torch.uint8, device=self._device)]
        self._at = self._used = self._taken = self._widest = 0

    def room(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` free bytes (8-aligned), not yet taken: see :meth:`take`."""
        self._widest = max(self._widest, nbytes)
        while self._at < len(self._chunks):
            free = self._chunks[self._at].numel() - self._used
            if free >= nbytes:
                return self._chunks[self._at][self._used:self._used + nbytes]
            self._at, self._used = self._at + 1, 0
        self._chunks.append(torch.empty(max(nbytes, self._chunk), dtype=torch.uint8, device=self._device))
        return self._chunks[self._at][:nbytes]

    def take(self, nbytes: int) -> None:
        """Keep the first ``nbytes`` of the last :meth:`room` (for this update)."""
        self._used += (nbytes + 7) // 8 * 8
        self._taken += (nbytes + 7) // 8 * 8

    @property
    def nbytes(self) -> int:
        return sum(c.numel() for c in self._chunks)


class Arenas:
    """One :class:`Arena` per kernel thread, lent out for a call at a time."""

    def __init__(self) -> None:
        self._all: list[Arena] = []
        self._free: queue.SimpleQueue[Arena] = queue.SimpleQueue()

    @contextmanager
    def lend(self) -> Iterator[Arena]:
        try:
            arena = self._free.get_nowait()
        except queue.Empty:
            arena = Arena()
            self._all.append(arena)
        try:
            yield arena
        finally:
            self._free.put(arena)

    def reset(self) -> None:
        for a in self._all:
            a.reset()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._all)


_pool: ThreadPoolExecutor | None = None


def threads() -> int:
    """Kernel threads: ``WEIGHTBUS_DELTA_THREADS``, else this process's cores up to 8 (a
    memory-bound diff gains little past that). Not torch's intra-op count: launchers set it
    to 1 for the torch ops of many processes on a host, while a diff or an apply runs when
    the rest of the update waits on it."""
    given = config.env_integer("WEIGHTBUS_DELTA_THREADS", minimum=1, maximum=256)
    if given is not None:
        return given
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(8, cores))


class Jobs:
    """Kernel calls on :func:`threads` threads (ctypes lets go of the GIL), their results in
    the order given, at most ``2 x threads`` in flight (each may hold a cast piece)."""

    def __init__(self) -> None:
        global _pool
        self._n = threads()
        if self._n > 1 and _pool is None:
            with _lock:
                if _pool is None:
                    _pool = ThreadPoolExecutor(max_workers=self._n, thread_name_prefix="weightbus-delta")
        self._pending: deque[Future[Any]] = deque()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Iterator[Any]:
        """Start ``fn(*args)``; yields the results that must be taken to stay in the window."""
        if self._n == 1 or _pool is None:
            yield fn(*args)
            return
        self._pending.append(_pool.submit(fn, *args))
        while len(self._pending) > 2 * self._n:
            yield self._pending.popleft().result()

    def drain(self) -> Iterator[Any]:
        """The results still in flight."""
        while self._pending:
            yield self._pending.popleft().result()


def diff_many(lib: ctypes.CDLL, rows: torch.Tensor, need: int, arena: Arena
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Diff every piece, a row ``[new values' address, snapshot's address, n, e, start, cap]``
    of ``rows`` (int64; flat host tensors; ``cap``: the most changes sent as positions), and
    set each snapshot to its new values, in one call; ``need``: bytes the bodies may take at
    most (the sum of ``pad8((n + 7) / 8) + n e``). Returns a row per piece, ``[kind, changed count,
    digest, offset, bytes]`` (kind: -1 nothing changed, 1 positions, 2 bitmap, 3 dense:
    send the values whole), an int64 tensor, and the room in ``arena`` the bodies lie in,
    one after the other (taken)."""
    table = rows.contiguous()
    out = arena.room(need)
    results = torch.empty(len(table), 5, dtype=torch.int64)
    used = lib.wb_diff_many(len(table), table.data_ptr(), out.data_ptr(), need, results.data_ptr())
    if used < 0:
        raise MemoryError(f"delta mode's diff of {len(table)} pieces: out of host memory")
    arena.take(used)
    return results, out


def apply_many(lib: ctypes.CDLL, rows: torch.Tensor) -> torch.Tensor:
    """Write every record, a row ``[kind, dst address, n, e, start, positions or bitmap
    address, values address, k]`` of ``rows`` (int64), in one call per thread. Returns
    ``[our digest, status]`` per record (see ``wb_apply_many``; a ``DIGEST`` row, kind 4,
    reads its range's digest and writes nothing)."""
    table = rows.contiguous()
    results = torch.zeros(len(table), 2, dtype=torch.int64)
    # split where the bytes written are even, so the threads get about as much work
    kind, n, e, k = table[:, 0], table[:, 2], table[:, 3], table[:, 7]
    work = torch.cumsum(torch.where((kind == 0) | (kind >= 3), n, k) * e, 0)
    parts = threads()
    cuts = torch.searchsorted(work, work[-1] * torch.arange(1, parts) // parts, right=True).tolist() \
        if parts > 1 and len(table) > 1 else []
    bounds = [0, *cuts, len(table)]

    def run(lo: int, hi: int) -> None:
        if hi > lo:
            lib.wb_apply_many(hi - lo, table.data_ptr() + 64 * lo, results.data_ptr() + 16 * lo)

    jobs = Jobs()
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        for _ in jobs.submit(run, lo, hi):
            pass
    for _ in jobs.drain():
        pass
    return results
