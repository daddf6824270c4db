"""weightbus as a native vLLM weight-transfer backend, named ``weightbus``.

Worker side (inside every vLLM worker; registered by the ``vllm.general_plugins`` entry
point that ``pip install weightbus[vllm]`` installs)::

    llm = LLM(model=path, weight_transfer_config={"backend": "weightbus"})

Trainer side (every trainer rank; rank 0 drives vLLM through ``client``)::

    from weightbus.integrations.vllm.native import WeightbusTrainerInitInfo
    info = WeightbusTrainerInitInfo(rank=r, world_size=T, rollout_world_size=R,
                                    master_address=host, master_port=port, transport="gloo")
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    engine.send_weights(version=step)   # start -> update (concurrent with the send) -> finish

``transport`` is any weightbus engine: ``gloo``, ``nccl``, ``colocated`` (CUDA IPC on
GPU, shared memory on CPU)... Every trainer rank sends its own share of the buckets; only
rank 0 talks to vLLM. The data plane is formed once at ``trainer_init`` (a rendezvous on
rank 0's TCPStore at ``master_address:master_port``) and reused by every update.

Each update is checked against the model before anything loads (see :mod:`.loader`): an
update vLLM cannot take fails on every rank, and vLLM keeps serving the previous weights.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

try:
    from vllm.distributed.weight_transfer.base import (
        TrainerInitInfo,
        TrainerWeightTransferEngine,
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
except ImportError as e:  # (before 0.26 these names do not exist)
    raise ImportError(f"weightbus's vLLM backend needs vllm>=0.28 (its native weight-transfer API); "
                      f"this vLLM lacks it ({e}): pip install 'weightbus[vllm]'") from e
if hasattr(WeightTransferEngine, "trainer_send_weights") or "backend" not in getattr(
        TrainerInitInfo, "__annotations__", {}):  # (0.26-0.27: an older form of the same API)
    raise ImportError("weightbus's vLLM backend needs vllm>=0.28 (its native weight-transfer API as "
                      "released there); this vLLM has an earlier form of it: pip install 'weightbus[vllm]'")

from weightbus import config
from weightbus.config import BUILTIN_TIMEOUT
from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry
from weightbus.errors import WeightbusError, WeightSyncError, as_timedelta
from weightbus.integrations.vllm import outcomes
from weightbus.integrations.vllm.loader import KEPT, VLLMModelLoader
from weightbus.integrations.vllm.processing import SelfCheck
from weightbus.plan import Manifest, TensorMeta
from weightbus.runtime.local import Rendezvous, connect
from weightbus.shards import Box, ShardLayout
from weightbus.sources import ModuleSource

NAME = "weightbus"
_log = logging.getLogger("vllm.weightbus")


@dataclass
class WeightbusInitInfo(WeightTransferInitInfo):
    """What a vLLM worker needs to join the weightbus group (sent by trainer rank 0)."""

    master_address: str
    master_port: int
    trainer_world_size: int = 1
    #: vLLM workers in the group, over every replica
    rollout_world_size: int = 1
    #: rollout index of this replica's first worker (replicas side by side)
    rank_offset: int = 0
    #: the weightbus engine: gloo, nccl, colocated...
    transport: str = "gloo"
    #: rendezvous key prefix; a new one for every formation of the group
    prefix: str = NAME
    #: more constructor arguments of the engine (bucket_size, timeout, num_buffers)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    #: allow updates that leave some parameters out
    partial: bool = False
    #: compare sampled layers with a fresh load every N-th update (0: off; see
    #: :class:`~weightbus.integrations.vllm.processing.SelfCheck`), L layers each time
    #: (0: all); unset (-1): from ``WEIGHTBUS_VLLM_SELF_CHECK`` in the worker
    self_check_every: int = -1
    self_check_layers: int = 0
    #: sharded receive: each worker receives only the regions its loaders keep, written
    #: in place as they arrive (None: where the transport can and vLLM runs more than one
    #: worker, or one worker is the only receiver, unless ``place`` is False; see
    #: :mod:`.placement`). A lone TP=1 worker's shard is the whole model, but then a
    #: tensor larger than a bucket is never staged whole
    sharded: bool | None = None
    #: write each received tensor where vLLM's loaders would put it (recorded once per
    #: manifest), calling a loader only where it transforms values (None: on; False: every
    #: tensor through vLLM's ``load_weights``, as unsharded updates did before)
    place: bool | None = None


@dataclass
class WeightbusUpdateInfo(WeightTransferUpdateInfo):
    """One update: its version (the trainer's step); 0 accepts whatever arrives."""

    version: int = 0


class WeightbusWeightTransferEngine(WeightTransferEngine[WeightbusInitInfo, WeightbusUpdateInfo]):
    """vLLM worker side: receive over any weightbus engine into ``model.load_weights``."""

    init_info_cls = WeightbusInitInfo
    update_info_cls = WeightbusUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._engine: CheckpointEngine | None = None
        self._loader: VLLMModelLoader | None = None
        self._start_error: Exception | None = None
        self._store: Any = None  # the group's rendezvous store: outcomes go there
        self._prefix = NAME
        self._loaders: dict[tuple[int, bool], VLLMModelLoader] = {}
        self._partial = self._sharded = self._places = False
        self._own: list[Exception] = []  # this worker's own failure in the update under way
        self._self_check: SelfCheck | None = None
        pc = self.parallel_config
        #: this worker's index among the replica's workers (data parallel included)
        self.local_rank = int(getattr(pc, "data_parallel_index", 0)) * int(pc.world_size) + int(pc.rank)
        self.rollout_rank = self.local_rank

    def where(self) -> str:
        return f"vLLM worker {self.rollout_rank}"

    def init_transfer_engine(self, init_info: WeightbusInitInfo) -> None:
        # Nothing here raises into vLLM (see .outcomes): a failure once the rendezvous
        # store is reached is posted to the rendezvous, so every rank fails at once,
        # naming this worker; one before that leaves the trainer naming it as missing.
        with outcomes.recorded(self.rollout_rank, "init_weight_transfer_engine", []):
            self.shutdown()
            T, R = init_info.trainer_world_size, init_info.rollout_world_size
            self.rollout_rank = init_info.rank_offset + self.local_rank
            if not 0 <= self.rollout_rank < R:
                raise WeightbusError(f"{self.where()}: outside the {R} rollout ranks the trainer "
                                     f"expects (rank_offset {init_info.rank_offset})")
            kwargs = dict(init_info.engine_kwargs)
            rdv = Rendezvous(init_info.master_address, init_info.master_port, T + self.rollout_rank,
                             T + R, timeout=config.timeout(kwargs.get("timeout")), prefix=init_info.prefix)
            try:
                if init_info.transport in ("nccl", "hccl", "colocated") and "device" not in kwargs:
                    kwargs["device"] = str(self.device)
                engine = CheckpointEngineRegistry.new(init_info.transport, role="rollout", **kwargs)
            except Exception as e:  # noqa: BLE001
                rdv.fail(f"{self.where()}: {e}")  # raises here too
            self._sharded = sharded_by_default(init_info, int(self.parallel_config.world_size)) \
                and hasattr(engine, "set_shard_destinations")
            self._places = init_info.place is not False
            if self._sharded:  # (each update's layout comes from the loader's preflight)
                engine.set_shard_destinations(_ToLoader(self))  # type: ignore[attr-defined]
            connect(engine, rdv, T, R)
            self._engine, self._partial = engine, init_info.partial
            self._store, self._prefix = rdv.store, init_info.prefix
            self._self_check = None if init_info.self_check_every < 0 else \
                SelfCheck(init_info.self_check_every, init_info.self_check_layers)
            self._loaders.clear()  # a new configuration: new loaders

    def start_weight_update(self) -> None:
        # the target is fixed now (vLLM may have pointed us at a draft model); the model
        # itself is touched only inside receive_weights. A failure here fails the update
        # that follows, on every rank (never a raise into vLLM: see .outcomes).
        self._loader, self._start_error = None, None
        try:
            key = (id(self.model), self._partial)
            if key not in self._loaders:  # kept per target: it caches its verdict per manifest
                self._loaders[key] = VLLMModelLoader(self.model, self.model_config,
                                                     partial=self._partial, where=self.where(),
                                                     self_check=self._self_check,
                                                     places=self._places or self._sharded)
            self._loader = self._loaders[key]
        except Exception as e:  # noqa: BLE001
            self._start_error = e

    def receive_weights(self, update_info: WeightbusUpdateInfo) -> None:
        """One update into the model. Never raises into vLLM: the outcome (with this
        worker's own cause, and whether its model kept the previous weights) goes to the
        driver through the group's store (see :mod:`.outcomes`)."""
        done: list[outcomes.Outcome] = []
        loader = self._loader
        with outcomes.recorded(self.rollout_rank, "update_weights", done,
                               kept=lambda: loader is None or not loader.touched):
            self._receive(update_info)
        _close_if_broken(self._engine)
        if self._store is not None:
            outcome = done[0]
            if outcome.ok and self._engine is not None and self._engine.last_stats is not None:
                outcome = dataclasses.replace(outcome, stats=self._engine.last_stats.to_dict())
            outcomes.post(self._store, self._prefix, "update", update_info.version, outcome)

    def _receive(self, update_info: WeightbusUpdateInfo) -> None:
        if self._engine is None:
            raise WeightbusError(f"{self.where()}: init_weight_transfer_engine comes first")
        loader = self._loader
        own = self._own = []  # this worker's cause (the agreed error is the first rank's)

        def validate(manifest: Manifest) -> None:
            try:
                if self._start_error is not None:
                    raise WeightbusError(f"{self.where()}: start_weight_update failed: {self._start_error}")
                loader.preflight(manifest)  # type: ignore[union-attr]
            except Exception as e:
                own.append(e)
                raise

        try:
            stream = self._engine.receive_weights_sync(
                validate=validate, on_release=loader.release if loader else None,
                on_complete=loader.complete if loader else None)
            try:
                if loader is None:
                    for _ in stream:
                        pass
                else:
                    loader.receive(stream)  # layerwise reload: initialized and finalized in here
            finally:
                stream.close()  # type: ignore[attr-defined]
        except Exception as e:
            cause = own[0] if own else e
            if loader is None or not loader.touched:
                raise WeightSyncError(str(cause) if KEPT in str(cause) else f"{cause} [{KEPT}]") from e
            raise WeightSyncError(str(cause)) from e
        if update_info.version and self._engine.version != update_info.version:
            raise WeightSyncError(f"{self.where()}: received version {self._engine.version}, "
                                  f"expected {update_info.version}")

    def finish_weight_update(self) -> None:
        self._loader = None  # receive_weights already finalized vLLM's layerwise reload

    def shutdown(self) -> None:
        if self._engine is not None:
            engine, self._engine, self._store = self._engine, None, None
            try:
                engine.finalize(destroy_group=True)
            except Exception as e:  # noqa: BLE001 - never into vLLM (see .outcomes); nothing left to do
                _log.warning("weightbus: %s: finalizing the engine: %s", self.where(), e)


def sharded_by_default(info: WeightbusInitInfo, workers: int) -> bool:
    """Whether a worker of a replica of ``workers`` workers receives sharded (where its
    transport can): as ``info.sharded`` says, else where the replica has several workers,
    or where one worker is the group's only receiver and placing is not turned off (its
    shard is the whole model, but a tensor split over buckets is placed piece by piece,
    never staged whole). Several TP=1 replicas keep the broadcast: a sharded plan is point
    to point, a copy per receiver."""
    if info.sharded is not None:
        return bool(info.sharded)
    return workers > 1 or (info.rollout_world_size == 1 and info.place is not False)


class _ToLoader:
    """The engine's shard destinations: the loader of the update under way (its layout
    recorded at the preflight, its regions written in place)."""

    def __init__(self, owner: WeightbusWeightTransferEngine):
        self.owner = owner

    def layout(self, manifest: Manifest) -> ShardLayout | None:
        loader = self.owner._loader
        return loader.layout(manifest) if loader is not None else None

    def place(self, name: str, box: Box, data: torch.Tensor) -> None:
        try:
            self.owner._loader.place(name, box, data)  # type: ignore[union-attr]
        except Exception as e:
            self.owner._own.append(e)  # (the engine reports the update's agreed error)
            raise


# ------------------------------------------------------------------ trainer side


@dataclass
class WeightbusTrainerInitInfo(TrainerInitInfo):
    """Trainer side of the ``weightbus`` backend (one per trainer rank, ``rank`` = its
    rank among the trainer ranks that send)."""

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


class WeightbusTrainerEngine(TrainerWeightTransferEngine[WeightbusTrainerInitInfo]):
    """Trainer side: every rank sends its buckets; rank 0 also drives vLLM's
    start -> update -> finish through the client, the update concurrently with the send."""

    init_info_cls = WeightbusTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, init_info: WeightbusTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=init_info.is_sender)
        self.info = init_info
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
                     source: Any = None) -> WeightbusTrainerEngine:
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

    def send_weights(self, version: int | None = None) -> Any:
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
            stats = _run(self.engine.send_weights(self.source, version=version))
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
                              timeout, failure, f"update to version {version}",
                              self.client.finish_weight_update,
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
            _log.warning("weightbus: closing a broken group: %s", e)


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


class _VLLMSource:
    """A vLLM ``WeightSource`` (metadata + a fresh iteration per round) as a weightbus
    source. Every trainer rank iterates it whole: its gathers are collectives."""

    def __init__(self, source: Any):
        self.source = source
        self.manifest = Manifest(TensorMeta(m.name, m.dtype, tuple(m.shape)) for m in source.metadata())

    def __iter__(self) -> Any:
        return iter(self.source)


def _as_source(source: Any) -> Any:
    if isinstance(source, torch.nn.Module):
        return ModuleSource(source)
    if hasattr(source, "metadata") and not hasattr(source, "manifest"):
        return _VLLMSource(source)
    return source


# ------------------------------------------------------------------ registration


def register() -> None:
    """Register both sides with vLLM's factories under ``weightbus``; safe to call again
    (vLLM raises on a second registration of a name)."""
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, cls_name in ((WeightTransferEngineFactory, "WeightbusWeightTransferEngine"),
                              (WeightTransferTrainerFactory, "WeightbusTrainerEngine")):
        if NAME in getattr(factory, "_registry", {}):
            continue
        try:
            factory.register_engine(NAME, __name__, cls_name)
        except ValueError:  # registered meanwhile (another thread or plugin load)
            if NAME not in getattr(factory, "_registry", {NAME: None}):
                raise


register()  # importing this module (trainer side) is enough to use the backend
