"""weightbus as a native vLLM weight-transfer backend, named ``weightbus``: the worker side,
inside every vLLM worker (registered by the ``vllm.general_plugins`` entry point that
installing weightbus adds)::

    llm = LLM(model=path, weight_transfer_config={"backend": "weightbus"})

The trainer side is :mod:`.trainer` (:func:`~weightbus.integrations.vllm.trainer_init`).
One class serves every vLLM from 0.24 on: what differs between versions (the engine's
constructor, who runs the layerwise reload, the ``load_weights`` argument of 0.24-0.25)
is read off vLLM's base class by :mod:`.compat`.

Each update is checked against the model before anything loads (see :mod:`.loader`): an
update vLLM cannot take fails on every rank, and vLLM keeps serving the previous weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from weightbus import config
from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry
from weightbus.errors import WeightbusError, WeightSyncError
from weightbus.integrations import outcomes
from weightbus.integrations.vllm import compat
from weightbus.integrations.vllm.loader import KEPT, VLLMModelLoader
from weightbus.integrations.vllm.processing import SelfCheck
from weightbus.integrations.vllm.trainer import (  # (the trainer side, once imported from here)
    NAME,
    WeightbusTrainerEngine,
    WeightbusTrainerInitInfo,
    _close_if_broken,
    trainer_init,
)
from weightbus.packing.shards import Box, ShardLayout
from weightbus.plan import Manifest
from weightbus.runtime.local import Rendezvous, connect

__all__ = ["WeightbusInitInfo", "WeightbusTrainerEngine", "WeightbusTrainerInitInfo",
           "WeightbusUpdateInfo", "WeightbusWeightTransferEngine", "register", "trainer_init"]
_log = compat._log




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
    """vLLM worker side: receive over any weightbus engine into the model (placed where
    vLLM's loaders put each tensor, or through ``model.load_weights``)."""

    init_info_cls = WeightbusInitInfo
    update_info_cls = WeightbusUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # (config, vllm_config, device, model) from vLLM 0.26, (config, parallel_config,
        # model) before: the base class takes whichever its vLLM passes
        super().__init__(*args, **kwargs)
        self._lifecycle = compat.worker_api()["lifecycle"]
        if not hasattr(self, "device"):  # 0.24-0.25
            self.device = compat.model_device(self.model)
        if getattr(self, "model_config", None) is None:
            self.model_config = compat.model_config_of(self.parallel_config)
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
        # Nothing here raises into vLLM (see weightbus.integrations.outcomes): a failure once the rendezvous
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
        # that follows, on every rank (never a raise into vLLM: see weightbus.integrations.outcomes).
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

    def receive_weights(self, update_info: WeightbusUpdateInfo, load_weights: Any = None) -> None:
        """One update into the model. Never raises into vLLM: the outcome (with this
        worker's own cause, and whether its model kept the previous weights) goes to the
        driver through the group's store (see :mod:`weightbus.integrations.outcomes`).

        ``load_weights`` is vLLM 0.24-0.25's: there vLLM's worker calls only this, so the
        update's start and finish run here, and vLLM must have been told the weights come
        in kernel format (``start_weight_update(is_checkpoint_format=False)``, what
        weightbus's rollout handles send), or it would run its own layerwise reload around
        weightbus's."""
        done: list[outcomes.Outcome] = []
        if not self._lifecycle:
            self.start_weight_update()
            if getattr(load_weights, "__name__", "") == "load_weights" and self._start_error is None:
                self._start_error = WeightbusError(
                    f"{self.where()}: this vLLM began its own layerwise reload: start the update with "
                    f"start_weight_update(is_checkpoint_format=False), as weightbus's rollout handles "
                    f"(OfflineLLMRollout, AsyncLLMRollout, HTTPRollout) do on vLLM 0.24-0.25")
        loader = self._loader
        with outcomes.recorded(self.rollout_rank, "update_weights", done,
                               kept=lambda: loader is None or not loader.touched):
            self._receive(update_info)
        if not self._lifecycle:
            self.finish_weight_update()
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

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """(vLLM 0.24-0.27's static trainer API) weightbus's trainer side is an engine
        object: :func:`weightbus.integrations.vllm.trainer_init`."""
        raise WeightbusError("weightbus sends from a trainer engine: "
                             "weightbus.integrations.vllm.trainer_init(info, client=..., source=...)")

    def shutdown(self) -> None:
        if self._engine is not None:
            engine, self._engine, self._store = self._engine, None, None
            try:
                engine.finalize(destroy_group=True)
            except Exception as e:  # noqa: BLE001 - never into vLLM (see weightbus.integrations.outcomes); nothing left to do
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


# ------------------------------------------------------------------ registration


def register() -> None:
    """Register both sides with vLLM's factories under ``weightbus`` (the trainer side only
    where this vLLM has a trainer factory, 0.26+); safe to call again."""
    compat.register_worker(NAME, __name__, "WeightbusWeightTransferEngine")
    compat.register_trainer(NAME, "weightbus.integrations.vllm.trainer", "WeightbusTrainerEngine")


register()  # importing this module is enough to use the backend
