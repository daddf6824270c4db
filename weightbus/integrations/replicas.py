"""An inference engine driven from the trainer's process, as one replica of
:class:`weightbus.manager.CheckpointEngineManager`: the manager's calls run one at a time
on the replica's own thread, and each answers as a :class:`~weightbus.runtime.group.Pending`
with a reply per engine worker. The vLLM and SGLang replicas build on this."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from weightbus import comm, config
from weightbus.integrations import outcomes
from weightbus.runtime.group import Pending, WorkerError


class Call:
    """A pending call on a replica, as the manager's :class:`Pending`; a worker's reply
    ``{FAILED: reason}`` is that worker's failure (see :mod:`weightbus.integrations.outcomes`)."""

    def __init__(self, name: str, method: str, fut: concurrent.futures.Future):
        self.name, self.method, self.fut = name, method, fut

    def result(self, timeout: float) -> list[Any]:
        try:
            replies = list(self.fut.result(timeout))
        except concurrent.futures.TimeoutError:
            raise WorkerError(self.name, self.method, {0: f"no answer within {timeout:.0f}s"},
                              {0: "timed out"}) from None
        except Exception as e:  # noqa: BLE001 - the engine re-raises its worker's error
            kind = "died" if "EngineDead" in type(e).__name__ else "raised"
            raise WorkerError(self.name, self.method, {0: f"{type(e).__name__}: {e}"}, {0: kind}) from e
        failed = {r: x[outcomes.FAILED] for r, x in enumerate(replies)
                  if isinstance(x, dict) and outcomes.FAILED in x}
        if failed:
            raise WorkerError(self.name, self.method, failed, dict.fromkeys(failed, "raised"))
        return replies


class EngineReplica:
    """``size`` engine workers behind one handle; subclasses map the manager's calls
    (``submit(method, args, kwargs)``) onto the engine. Kept here: the engine the manager
    set up (``wb_setup``), where the group's rendezvous is and this replica's first rank
    in it (``wb_connect``), and a connection to that store, where the workers' outcomes
    are read."""

    def __init__(self, name: str, size: int):
        self.name, self._size = name, size
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"wb-{name}")
        self._setup: tuple[str, dict[str, Any]] = ("gloo", {})
        self._group: tuple[str, int, str, int] = ("", 0, "", 0)  # the manager's store; our first rank
        self._store: Any = None
        self._store_of: tuple[str, int] | None = None

    def _set_up(self, method: str, args: Any) -> Pending:
        """``wb_setup``: the backend and engine options every worker will build with."""
        backend, _, engine_kwargs = args[0][:3]
        self._setup = (backend, dict(engine_kwargs))
        return self._submit(method, lambda: None)

    def _timeout(self) -> float:
        return float(self._setup[1].get("timeout") or config.timeout(None))

    def _store_at(self, addr: str, port: int) -> Any:
        """The group's rendezvous store, connected once per address."""
        if self._store is None or self._store_of != (addr, port):
            self._store = comm.connect_store(addr, port, self._timeout(), f"replica {self.name}")
            self._store_of = (addr, port)
        return self._store

    @property
    def size(self) -> int:
        return self._size

    def _submit(self, method: str, fn: Callable[[], Any]) -> Pending:
        return Call(self.name, method, self._pool.submit(lambda: [fn()] * self._size))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
