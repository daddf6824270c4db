"""weightbus's trainer side for vLLM's ``weightbus`` weight-transfer backend: one call on
every trainer rank, the same on every vLLM from 0.24 to 0.33, with or without vLLM in the
trainer's process::

    from weightbus.integrations.vllm import WeightbusTrainerInitInfo, trainer_init
    info = WeightbusTrainerInitInfo(rank=r, world_size=T, rollout_world_size=R,
                                    master_address=host, master_port=port, transport="gloo")
    engine = trainer_init(info, client=client, source=source)
    engine.send_weights(version=step)   # start -> update (concurrent with the send) -> finish

``transport`` is any weightbus engine: ``gloo``, ``nccl``, ``colocated`` (CUDA IPC on
GPU, shared memory on CPU)... Every trainer rank sends its own share of the buckets; only
rank 0 talks to vLLM, through ``client`` (a :class:`~.rollouts.RolloutClient`, or any
object with vLLM's four weight-sync calls). The data plane is formed once at
``trainer_init`` (a rendezvous on rank 0's TCPStore at ``master_address:master_port``)
and reused by every update. Where vLLM has a trainer factory (0.26+), the same engine is
registered there too: ``WeightTransferTrainerFactory.trainer_init(info, client=...,
source=...)`` builds it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from weightbus.config import BUILTIN_TIMEOUT
from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry
from weightbus.errors import WeightbusError, WeightSyncError, as_timedelta
from weightbus.integrations import outcomes
from weightbus.integrations.vllm import compat
from weightbus.runtime.local import Rendezvous, connect
from weightbus.sources import ModuleSource

#: the backend's name, in vLLM's factories and its ``weight_transfer_config``
NAME = "weightbus"

@dataclass
class WeightbusTrainerInitInfo:
    """Trainer side of the ``weightbus`` backend (one per trainer rank, ``rank`` = its
    rank among the trainer ranks that send; rank 0 drives vLLM). Checked as it is made."""

    #: vLLM's trainer factory (0.27+) picks the engine by this name
    backend: ClassVar[str] = NAME

    #: this host (trainer rank 0), as vLLM's workers and the other trainer ranks reach it
    master_address: str
    #: a free port there: rank 0 serves the rendezvous store on it
    master_port: int
    #: trainer ranks that send (each sends its own share of the buckets)
    world_size: int = 1
    #: vLLM workers to update, over every replica
    rollout_world_size: int = 1
    transport: str = "gloo"
    bucket_size: int | None = None
    #: bucket slots on each side (None: the engine's default); more let the trainer run
    #: ahead while vLLM processes a layer
    num_buffers: int | None = None
    timeout: float = BUILTIN_TIMEOUT
    partial: bool = False
    #: vLLM's workers compare sampled layers with a fresh load every N-th update (0: off,
    #: -1: as ``WEIGHTBUS_VLLM_SELF_CHECK`` says there), L layers each time (0: all)
    self_check_every: int = -1
    self_check_layers: int = 0
    #: vLLM's workers receive only their shards, placed as they arrive (None: where the
    #: transport can and a replica has several workers, or a lone worker receives)
    sharded: bool | None = None
    #: vLLM's workers write each tensor where its loaders would, calling a loader only where
    #: it transforms values (None: on)
    place: bool | None = None
    #: this trainer rank (keyword only, as in vLLM's ``TrainerInitInfo``)
    rank: int = field(kw_only=True)

    def __post_init__(self) -> None:
        def bad(what: str) -> WeightbusError:
            return WeightbusError(f"WeightbusTrainerInitInfo: {what}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise bad(f"world_size must be a positive int, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise bad(f"rank must be in [0, {self.world_size}), got {self.rank!r}")
        if not isinstance(self.rollout_world_size, int) or self.rollout_world_size < 1:
            raise bad(f"rollout_world_size must be a positive int, got {self.rollout_world_size!r}")
        if not isinstance(self.master_port, int) or not 0 < self.master_port < 65536:
            raise bad(f"master_port must be a port number (1-65535), got {self.master_port!r}")
        if not self.master_address or not isinstance(self.master_address, str):
            raise bad(f"master_address must be a host name or address, got {self.master_address!r}")
        CheckpointEngineRegistry.get(self.transport)  # an unknown transport: named, with the list
        if not self.timeout or self.timeout <= 0:
            raise bad(f"timeout must be positive seconds, got {self.timeout!r}")

    @property
    def is_sender(self) -> bool:
        """Rank 0 talks to vLLM; every rank sends its share of the buckets."""
        return self.rank == 0


class WeightbusTrainerEngine:
    """Trainer side: every rank sends its buckets; rank 0 also drives vLLM's
    start -> update -> finish through the client, the update concurrently with the send.
    Build it with :func:`trainer_init` (or vLLM's ``WeightTransferTrainerFactory``)."""

    init_info_cls = WeightbusTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, init_info: WeightbusTrainerInitInfo):
        if not isinstance(init_info, WeightbusTrainerInitInfo):
            raise WeightbusError(f"the weightbus trainer engine takes a WeightbusTrainerInitInfo, "
                                 f"got {type(init_info).__name__}")
        self.info = init_info
        self.is_sender = init_info.is_sender
        self.client = client
        self.source = source
        self._finish = _finisher(client) if self.is_sender else None
        kwargs: dict[str, Any] = {"timeout": init_info.timeout}
        if init_info.bucket_size is not None:
            kwargs["bucket_size"] = init_info.bucket_size
        if init_info.num_buffers is not None:
            kwargs["num_buffers"] = init_info.num_buffers
        self.engine_kwargs = kwargs
        self.engine = CheckpointEngineRegistry.new(init_info.transport, role="trainer", **kwargs)
        self.version = 0
        self._formations = 0
        self._store: Any = None
        self._prefix = NAME
        self._interrupted: str | None = None  # an update was interrupted: the group was closed
        #: rank 0: every vLLM worker's ``UpdateStats`` of the last update, as dicts (``bytes``:
        #: what it received; ``fallbacks``: tensors it took whole in a sharded update);
        #: None for a worker that failed
        self.rollout_stats: list[dict[str, Any] | None] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="wb-vllm-rpc")

    @classmethod
    def trainer_init(cls, init_info: WeightbusTrainerInitInfo, *, client: Any,
                     source: Any = None, config: Any = None) -> WeightbusTrainerEngine:
        """Build the engine and form the group (every trainer rank). ``config`` is what
        vLLM 0.26's factory passes; weightbus needs none."""
        if source is None:
            raise WeightbusError("the weightbus trainer engine needs a source of weights")
        self = cls(client=client, source=source, init_info=init_info)
        self.connect()
        return self

    def connect(self) -> None:
        """(Re-)form the group with vLLM's workers; after a transport failure, call it on
        every trainer rank to rebuild."""
        info = self.info
        T, R = info.world_size, info.rollout_world_size
        self._formations += 1
        self._interrupted = None
        prefix = f"{NAME}/{self._formations}"  # the same count on every trainer rank
        if self.is_sender and self._store is None:  # the rendezvous store, on rank 0
            self._store = torch.distributed.TCPStore("0.0.0.0", info.master_port, None, True,
                                                     timeout=as_timedelta(info.timeout),
                                                     wait_for_workers=False)
        pending = None
        if self.is_sender:
            pending = self._pool.submit(self.client.init_weight_transfer_engine, {
                "master_address": info.master_address, "master_port": info.master_port,
                "trainer_world_size": T, "rollout_world_size": R, "transport": info.transport,
                "prefix": prefix, "engine_kwargs": self.engine_kwargs, "partial": info.partial,
                "self_check_every": info.self_check_every, "self_check_layers": info.self_check_layers,
                "sharded": info.sharded, "place": info.place})
        self._prefix = prefix
        rdv = Rendezvous(info.master_address, info.master_port, info.rank, T + R,
                         timeout=info.timeout, prefix=prefix)
        try:
            connect(self.engine, rdv, T, R)
        except BaseException:
            if pending is not None and pending.done():
                pending.result()  # vLLM's own error says more than the rendezvous timeout
            raise
        if pending is not None:
            _result(pending, info.timeout, "init_weight_transfer_engine")

    @property
    def source(self) -> Any:
        """What each update sends; assign a new one when the set of tensors changes: a
        weightbus source (``ModuleSource``), an ``nn.Module``, or a vLLM ``WeightSource``."""
        return self._source

    @source.setter
    def source(self, value: Any) -> None:
        self._source = _as_source(value)

    def send_weights(self, version: int | None = None, *, rollback: bool = False) -> Any:
        """One update; returns weightbus's :class:`UpdateStats`. Raises
        :class:`WeightSyncError` on every trainer rank if any rank (or vLLM worker) failed;
        on rank 0 it names every vLLM worker that failed and its cause, and says whether
        vLLM kept its previous weights (a replica holding some new layers has its weight
        version set to ``"none"``). Every vLLM call of the update is closed either way, so
        the next pause, update and generate work. After a failure that broke the group
        (a peer lost, a deadline), a single trainer rank re-forms it at its next update;
        several ranks call :meth:`connect` on every rank."""
        version = self.version + 1 if version is None else int(version)
        if (self.engine.broken or self._interrupted) and self.info.world_size == 1:
            self.connect()
        elif self._interrupted:
            raise WeightSyncError(f"trainer rank {self.info.rank}: the group was closed when an update was "
                                  f"interrupted ({self._interrupted}); call connect() on every trainer rank")
        pending = None
        if self.is_sender:
            self.client.start_weight_update()
            pending = self._pool.submit(self.client.update_weights, {"version": version})
        failure: BaseException | None = None
        stats = None
        try:
            if pending is not None and pending.done():
                pending.result()  # a bad request fails at once: do not wait in the send
            stats = _run(self.engine.send_weights(self.source, version=version, rollback=rollback))
        except BaseException as e:
            failure = e
            if not isinstance(e, WeightSyncError):  # interrupted mid-update: the group is unusable
                self._interrupted = f"{type(e).__name__}"
            _close_if_broken(self.engine, force=self._interrupted is not None)  # (vLLM's workers fail now)
        if pending is None:
            if failure is not None:
                raise failure
            self.version = version
            return stats
        self._settle(pending, version, failure)
        self.version = version
        return stats

    def _settle(self, pending: concurrent.futures.Future, version: int,
                failure: BaseException | None) -> None:
        """Rank 0, after its send: vLLM's update call returned, every worker's outcome read,
        vLLM's update closed (with the version only if every worker succeeded)."""
        timeout = self.info.timeout
        concurrent.futures.wait([pending], timeout=timeout)
        try:
            if pending.done():
                pending.result()
            else:
                raise WeightSyncError(f"vLLM did not answer update_weights within {timeout:.0f}s")
        except Exception as e:  # noqa: BLE001 - vLLM's own error (the engine died, a bad request)
            failure = failure or e
        seen: list[outcomes.Outcome] = []
        why = outcomes.settle(self._store, self._prefix, version, range(self.info.rollout_world_size),
                              timeout, failure, f"update to version {version}", self._finish,
                              getattr(self.client, "mark_torn", lambda ranks: None), seen)
        self.rollout_stats = [o.stats for o in seen]
        if why is None:
            return
        if isinstance(failure, Exception) or failure is None:
            raise WeightSyncError(why) from failure
        raise failure  # an interrupt stays one; vLLM was left closed and consistent

    def shutdown(self) -> None:
        self.engine.finalize(destroy_group=True)
        if self.is_sender and hasattr(self.client, "shutdown_weight_transfer_engine"):
            try:
                self.client.shutdown_weight_transfer_engine()
            except Exception:  # noqa: BLE001 - the engine may be gone already
                pass
        self._pool.shutdown(wait=False)
        self._store = None


def _close_if_broken(engine: CheckpointEngine | None, force: bool = False) -> None:
    """A group that lost a peer or a deadline (or, ``force``, whose update was interrupted)
    cannot carry updates any more: close it, so that every other rank still waiting in it
    fails now, not at its own deadline."""
    if engine is not None and (engine.broken or force):
        try:
            engine.finalize(destroy_group=True)
        except Exception as e:  # noqa: BLE001 - closing is best effort; the group is re-formed anyway
            compat._log.warning("weightbus: closing a broken group: %s", e)


def _result(fut: concurrent.futures.Future, timeout: float, what: str) -> Any:
    try:
        return fut.result(timeout)
    except concurrent.futures.TimeoutError:
        raise WeightSyncError(f"vLLM did not answer {what} within {timeout:.0f}s") from None


def _run(coro: Any) -> Any:
    try:
        asyncio.get_running_loop()
        running = True
    except RuntimeError:
        running = False
    if not running:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from async code
        return pool.submit(asyncio.run, coro).result()


def _as_source(source: Any) -> Any:
    if isinstance(source, torch.nn.Module):
        return ModuleSource(source)
    if hasattr(source, "metadata") and not hasattr(source, "manifest"):
        return compat.VLLMWeightSource(source)  # a vLLM WeightSource, any version's form
    return source


def _finisher(client: Any) -> Any:
    """``client.finish_weight_update`` called with the version where it takes one (weightbus's
    clients, vLLM 0.27+'s), without it otherwise (vLLM 0.26's clients)."""
    import inspect
    finish = client.finish_weight_update
    try:
        params = inspect.signature(finish).parameters.values()
    except (TypeError, ValueError):  # unreadable: assume the current form
        return finish
    if any(p.kind is not p.KEYWORD_ONLY for p in params):
        return finish
    return lambda version: finish()


def trainer_init(init_info: WeightbusTrainerInitInfo, *, client: Any, source: Any) -> WeightbusTrainerEngine:
    """Build weightbus's trainer engine and form the group with vLLM's workers: call it on
    every trainer rank (rank 0 drives vLLM through ``client``). ``source``: a weightbus
    source (``ModuleSource``, ``HFCheckpointSource``, ``QuantizedSource``...), an
    ``nn.Module``, or a vLLM ``WeightSource``. The same call on every vLLM from 0.24."""
    return WeightbusTrainerEngine.trainer_init(init_info, client=client, source=source)

