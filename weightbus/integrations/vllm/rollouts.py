"""vLLM engines as rollouts: one handle per way of running vLLM, the same calls on each.

A handle is vLLM's weight-sync control plane (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``: what a
``TrainerWeightTransferEngine`` drives) plus generation control (``pause`` / ``resume``,
``sleep`` / ``wake_up``) and the weight version:

- :class:`OfflineLLMRollout`: an offline ``vllm.LLM`` (pause = ``sleep(level=0)``);
- :class:`AsyncLLMRollout`: an ``AsyncLLM`` on its event loop (``pause_generation``);
- :class:`HTTPRollout`: ``vllm serve`` with ``VLLM_SERVER_DEV_MODE=1`` (``/pause``...).

They are used three ways:

- :class:`RolloutClient`: several handles as one client of the native trainer engine;
  it gives each replica's workers their own ranks;
- :func:`sync_weights`: pause every rollout (``keep`` + clear cache by default) ->
  update -> finish with the version -> resume (also after a failed update, which leaves
  the previous weights in place when vLLM rejected it up front);
- :class:`VLLMEngineReplica`: a handle as a replica of
  :class:`weightbus.manager.CheckpointEngineManager`.

:class:`VLLMReplica` is the manager replica for the older ``worker_extension_cls`` path.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

from weightbus import config
from weightbus.errors import WeightbusError
from weightbus.integrations import outcomes
from weightbus.integrations.replicas import Call, EngineReplica
from weightbus.integrations.vllm import compat
from weightbus.runtime.group import Pending

#: Pause modes vLLM knows: ``keep`` freezes in-flight requests (they continue after the
#: update), ``abort`` ends them with finish reason ``abort``, ``wait`` lets them finish.
PAUSE_MODES = ("keep", "abort", "wait")


class Rollout:
    """One vLLM engine (all its workers); subclasses map each call onto the engine. Where
    the engine keeps no weight versions (vLLM 0.24-0.26), the handle keeps the version of
    the updates it drove (:attr:`local_version`)."""

    name: str = "vllm"
    #: vLLM workers behind this engine (each is one rank of the weight-sync group)
    size: int = 1
    #: the version this handle recorded, for engines that keep none
    local_version: str | None = None

    # vLLM's weight-sync control plane (VLLMWeightSyncClient)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        raise NotImplementedError

    def start_weight_update(self) -> None:
        raise NotImplementedError

    def update_weights(self, update_info: dict[str, Any]) -> None:
        raise NotImplementedError

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        raise NotImplementedError

    def shutdown_weight_transfer_engine(self) -> None:
        raise NotImplementedError

    # versions and generation control
    def weight_version(self) -> str | None:
        raise NotImplementedError

    def set_weight_version(self, version: str) -> None:
        raise NotImplementedError

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        """Stop generating before an update; see :data:`PAUSE_MODES`."""
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def sleep(self, level: int = 1) -> None:
        raise NotImplementedError

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the engine: all of it, or only ``tags`` (``"weights"`` before an update,
        then ``"kv_cache"``: the hybrid order that never holds both beside a trainer)."""
        raise NotImplementedError


def _check_mode(mode: str) -> str:
    if mode not in PAUSE_MODES:
        raise WeightbusError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
    return mode


class OfflineLLMRollout(Rollout):
    """An offline ``vllm.LLM`` built with ``weight_transfer_config={"backend": "weightbus"}``.
    It generates only inside ``generate()``; pausing holds the scheduler (``sleep(level=0)``)
    so requests another thread submits wait for the new weights."""

    def __init__(self, llm: Any, name: str = "vllm"):
        self.llm, self.name = llm, name
        self.size = int(llm.llm_engine.vllm_config.parallel_config.world_size)
        self.calls = compat.Calls(llm, f"vLLM {compat.installed_version()}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update(**self.calls.start_kwargs())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.calls.versions:
            self.llm.finish_weight_update(weight_version)
            return
        self.llm.finish_weight_update()
        if weight_version is not None:
            self.local_version = weight_version

    def shutdown_weight_transfer_engine(self) -> None:
        if self.calls.shutdown:
            self.llm.shutdown_weight_transfer_engine()

    def weight_version(self) -> str | None:
        return self.llm.get_weight_version() if self.calls.versions else self.local_version

    def set_weight_version(self, version: str) -> None:
        if self.calls.versions:
            self.llm.update_weight_version(version)
        else:
            self.local_version = version

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self.llm.sleep(level=0, mode=_check_mode(mode))
        if clear_cache:  # level 0 keeps the caches; KV of the old weights must go
            self.llm.reset_prefix_cache(reset_running_requests=True)

    def resume(self) -> None:
        self.llm.wake_up(tags=["scheduling"])

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags)


class AsyncLLMRollout(Rollout):
    """A ``vllm.v1.engine.async_llm.AsyncLLM`` serving on ``loop`` (default: the loop
    running where this is built). Calls block the calling thread, which must not be the
    loop's own (use ``asyncio.to_thread`` from async code)."""

    def __init__(self, engine: Any, loop: asyncio.AbstractEventLoop | None = None, *,
                 name: str = "vllm", timeout: float | None = None):
        self.engine, self.name, self.timeout = engine, name, config.timeout(timeout)
        self.loop = loop or asyncio.get_running_loop()
        self.size = int(engine.vllm_config.parallel_config.world_size)
        self.calls = compat.Calls(engine, f"vLLM {compat.installed_version()}")

    def _call(self, fn: Callable[[], Any]) -> Any:
        if getattr(self.loop, "_thread_id", None) == threading.get_ident():
            raise WeightbusError("AsyncLLMRollout blocks: call it from another thread than the "
                                 "engine's event loop (asyncio.to_thread)")

        async def run() -> Any:
            return await fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(self.timeout)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest
        self._call(lambda: self.engine.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._call(lambda: self.engine.start_weight_update(**self.calls.start_kwargs()))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest
        self._call(lambda: self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if self.calls.versions:
            self._call(lambda: self.engine.finish_weight_update(weight_version))
            return
        self._call(self.engine.finish_weight_update)
        if weight_version is not None:
            self.local_version = weight_version

    def shutdown_weight_transfer_engine(self) -> None:
        if self.calls.shutdown:
            self._call(self.engine.shutdown_weight_transfer_engine)

    def weight_version(self) -> str | None:
        return self._call(self.engine.get_weight_version) if self.calls.versions else self.local_version

    def set_weight_version(self, version: str) -> None:
        if self.calls.versions:
            self._call(lambda: self.engine.update_weight_version(version))
        else:
            self.local_version = version

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self._call(lambda: self.engine.pause_generation(mode=_check_mode(mode), clear_cache=clear_cache))

    def resume(self) -> None:
        self._call(self.engine.resume_generation)

    def sleep(self, level: int = 1) -> None:
        self._call(lambda: self.engine.sleep(level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call(lambda: self.engine.wake_up(tags))


class HTTPRollout(Rollout):
    """``vllm serve ... --weight-transfer-config '{"backend": "weightbus"}'`` started with
    ``VLLM_SERVER_DEV_MODE=1`` (which adds the pause and weight routes). ``workers``:
    the server's vLLM workers (TP x PP x DP)."""

    def __init__(self, base_url: str, *, workers: int = 1, name: str | None = None,
                 timeout: float | None = None):
        self.base_url, self.size, self.timeout = base_url.rstrip("/"), int(workers), config.timeout(timeout)
        self.name = name or self.base_url
        self._has_versions: bool | None = None

    def _request(self, path: str, body: dict[str, Any] | None = None, query: dict[str, Any] | None = None,
                 method: str = "POST") -> Any:
        url = f"{self.base_url}/{path}"
        if query:
            url += "?" + urllib.parse.urlencode(query, doseq=True)
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            cls = _NotFound if e.code == 404 else WeightbusError
            raise cls(f"{self.name}: {method} /{path} answered {e.code}: "
                      f"{e.read().decode(errors='replace')[:2000]}") from None
        except OSError as e:
            raise WeightbusError(f"{self.name}: {method} /{path} failed: {e}") from None
        return json.loads(raw) if raw else None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._request("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        # (vLLM 0.24-0.25 read the flag: weightbus runs the layerwise reload; later ones ignore it)
        self._request("start_weight_update", {"is_checkpoint_format": False})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._request("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        # (vLLM 0.24-0.26 ignore the version: the handle keeps it, see weight_version)
        self._request("finish_weight_update", {"weight_version": weight_version})
        if weight_version is not None:
            self.local_version = weight_version

    def _versions(self) -> bool:
        """Whether the server keeps weight versions (vLLM 0.27+: ``/weight_info``)."""
        if self._has_versions is None:
            try:
                self._request("weight_info", method="GET")
                self._has_versions = True
            except _NotFound:
                self._has_versions = False
                compat.say_once("versions", "weightbus: %s keeps no weight versions (vLLM 0.27+ does): "
                                "the rollout handle keeps the version of the updates it drives", self.name)
        return self._has_versions

    def shutdown_weight_transfer_engine(self) -> None:
        try:
            self._request("shutdown_weight_transfer_engine")
        except _NotFound:  # (vLLM 0.24-0.27: the next init replaces the engine)
            pass

    def weight_version(self) -> str | None:
        if not self._versions():
            return self.local_version
        return self._request("weight_info", method="GET")["weight_version"]

    def set_weight_version(self, version: str) -> None:
        if self._versions():
            self._request("update_weight_version", {"new_version": version})
        else:
            self.local_version = version

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self._request("pause", query={"mode": _check_mode(mode), "clear_cache": str(clear_cache).lower()})

    def resume(self) -> None:
        self._request("resume")

    def sleep(self, level: int = 1) -> None:
        self._request("sleep", query={"level": level})

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._request("wake_up", query={"tags": tags} if tags else None)


class _NotFound(WeightbusError):
    """The server has no such route (an older vLLM)."""


# ------------------------------------------------------------------ several rollouts


class RolloutClient:
    """Several rollouts as the one client a ``TrainerWeightTransferEngine`` drives. Calls
    go to every rollout at once; each rollout's workers get ranks after the previous
    rollouts' (``rank_offset``). ``timeout``: every call's deadline, seconds (an update
    call lasts as long as the transfer: raise it for models that take longer)."""

    def __init__(self, rollouts: Sequence[Rollout], *, timeout: float | None = None):
        if not rollouts:
            raise WeightbusError("RolloutClient needs at least one rollout")
        self.rollouts, self.timeout = list(rollouts), config.timeout(timeout)
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.rollouts),
                                                           thread_name_prefix="wb-rollouts")

    @property
    def rollout_world_size(self) -> int:
        return sum(r.size for r in self.rollouts)

    @property
    def offsets(self) -> list[int]:
        """Each rollout's first rank among the client's rollout ranks."""
        offsets, off = [], 0
        for r in self.rollouts:
            offsets.append(off)
            off += r.size
        return offsets

    def mark_torn(self, ranks: Sequence[int]) -> None:
        """The rollouts holding these rollout ranks may serve a mix of old and new layers
        after a failed update: their weight version becomes ``"none"`` until an update
        completes (what they generate meanwhile is from no single version)."""
        self._each("update_weight_version", lambda r, first: r.set_weight_version("none")
                   if any(first <= t < first + r.size for t in ranks) else None)

    def _each(self, what: str, call: Callable[[Rollout, int], Any]) -> list[Any]:
        futs = [self._pool.submit(call, r, o) for r, o in zip(self.rollouts, self.offsets, strict=True)]
        deadline = time.monotonic() + self.timeout
        errors, out = [], []
        for r, f in zip(self.rollouts, futs, strict=True):
            try:
                out.append(f.result(max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                errors.append(f"{r.name}: {what} did not answer within {self.timeout:.0f}s")
            except Exception as e:  # noqa: BLE001 - collected, every rollout is waited for
                errors.append(f"{r.name}: {what}: {type(e).__name__}: {e}")
        if errors:
            raise WeightbusError("; ".join(errors))
        return out

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._each("init_weight_transfer_engine",
                   lambda r, off: r.init_weight_transfer_engine({**init_info, "rank_offset": off}))

    def start_weight_update(self) -> None:
        self._each("start_weight_update", lambda r, _: r.start_weight_update())

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._each("update_weights", lambda r, _: r.update_weights(update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._each("finish_weight_update", lambda r, _: r.finish_weight_update(weight_version))

    def shutdown_weight_transfer_engine(self) -> None:
        self._each("shutdown_weight_transfer_engine", lambda r, _: r.shutdown_weight_transfer_engine())

    def pause(self, mode: str = "keep", clear_cache: bool = True) -> None:
        self._each(f"pause({mode})", lambda r, _: r.pause(mode, clear_cache))

    def resume(self) -> None:
        self._each("resume", lambda r, _: r.resume())


def sync_weights(engine: Any, client: RolloutClient, version: int | None = None, *,
                 mode: str = "keep", clear_cache: bool = True) -> Any:
    """Trainer rank 0's step: pause every rollout -> ``engine.send_weights`` (start,
    update, finish with the version) -> resume. Other trainer ranks call only
    ``engine.send_weights(version)``. Generation resumes after a failed update too: vLLM
    then still holds the previous weights if it rejected the update up front."""
    client.pause(mode, clear_cache)
    try:
        return engine.send_weights(version)
    finally:
        client.resume()


# ------------------------------------------------------------------ manager replicas


class VLLMEngineReplica(EngineReplica):
    """A :class:`Rollout` (a vLLM engine on the native ``weightbus`` backend) as one
    replica of :class:`weightbus.manager.CheckpointEngineManager`. ``mode`` overrides the
    manager's pause mode for this replica."""

    def __init__(self, rollout: Rollout, name: str | None = None, *, mode: str | None = None):
        super().__init__(name or rollout.name, rollout.size)
        self.rollout = rollout
        self.mode = _check_mode(mode) if mode else None

    def submit(self, method: str, args: Sequence[tuple] | None = None,
               kwargs: Sequence[dict] | None = None) -> Pending:
        r = self.rollout
        if method == "wb_setup":
            return self._set_up(method, args)
        if method == "wb_connect":
            addr, port, prefix, rank, T, R = args[0]  # type: ignore[index]
            info = {"master_address": addr, "master_port": port, "prefix": prefix,
                    "trainer_world_size": T, "rollout_world_size": R, "rank_offset": rank - T,
                    "transport": self._setup[0], "engine_kwargs": self._setup[1]}
            self._group = (addr, port, prefix, rank - T)
            return self._submit(method, lambda: r.init_weight_transfer_engine(info))
        if method == "wb_receive":
            return self._submit(method, lambda: self._receive(int(args[0][0])))  # type: ignore[index]
        if method == "wb_version":
            return self._submit(method, self._version)
        if method == "wb_formats":  # (what it serves in fp8: vLLM's CPU build serves none)
            return self._submit(method, dict)
        if method == "pause_generation":
            mode = self.mode or (kwargs[0].get("mode") if kwargs else None) or "keep"
            return self._submit(method, lambda: r.pause(mode))
        if method == "resume_generation":
            return self._submit(method, r.resume)
        if method in ("sleep", "wake_up"):
            return self._submit(method, getattr(r, method))
        if method == "wb_teardown":
            return self._submit(method, r.shutdown_weight_transfer_engine)
        raise WeightbusError(f"{self.name}: a vLLM replica has no call {method!r}")

    def _receive(self, version: int) -> dict[str, Any]:
        """One update; every worker's outcome read from the group's store (vLLM's own
        call never carries a worker's failure: see :mod:`weightbus.integrations.outcomes`),
        vLLM's update closed either way, a torn replica's version withdrawn."""
        r, (addr, port, prefix, first) = self.rollout, self._group
        timeout = self._timeout()
        store = self._store_at(addr, port)
        r.start_weight_update()
        failure: Exception | None = None
        try:
            r.update_weights({"version": version})
        except Exception as e:  # noqa: BLE001 - vLLM's own error (a dead engine, a deadline)
            failure = e
        why = outcomes.settle(store, prefix, version, range(first, first + self.size), timeout, failure,
                              f"{self.name}: update to version {version}", r.finish_weight_update,
                              lambda torn: r.set_weight_version("none"))  # (loading had begun)
        if why is None:
            return {"bytes": 0}
        raise WeightbusError(why)

    def _version(self) -> int | None:
        v = self.rollout.weight_version()
        return int(v) if v is not None and str(v).isdigit() else None


class VLLMReplica(EngineReplica):
    """An offline ``vllm.LLM`` built with ``WeightbusWorkerExtension`` (the fallback for
    vLLMs without the native weight-transfer API) as one replica of the manager; its TP
    workers are the group's ranks."""

    def __init__(self, llm: Any, name: str = "vllm"):
        super().__init__(name, int(llm.llm_engine.vllm_config.parallel_config.world_size))
        self.llm = llm

    def submit(self, method: str, args: Sequence[tuple] | None = None,
               kwargs: Sequence[dict] | None = None) -> Pending:
        if method in ("sleep", "wake_up"):
            return self._submit(method, getattr(self.llm, method))
        if method == "resume_generation":
            # KV blocks cached for a prompt hold the old weights' keys and values
            return self._submit(method, self.llm.reset_prefix_cache)
        args_l = [tuple(a) for a in args] if args else None
        kwargs_l = [dict(k) for k in kwargs] if kwargs else None
        return Call(self.name, method, self._pool.submit(
            self.llm.collective_rpc, "wb_dispatch", args=(method, args_l, kwargs_l)))
