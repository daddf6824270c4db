"""weightbus's engines inside verl's own checkpoint-engine manager (verl 0.9.x).

Importing this module registers every weightbus backend in verl's
``CheckpointEngineRegistry`` as ``weightbus.<name>`` (``weightbus.gloo``,
``weightbus.nccl``, ``weightbus.hccl``, ``weightbus.nixl``, ``weightbus.mooncake``,
``weightbus.colocated``, ``weightbus.shm``, ``weightbus.disk``). verl imports it on every
worker before it builds the backend when its config names it::

    actor_rollout_ref.rollout.checkpoint_engine.backend=weightbus.nccl
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=weightbus.integrations.verl

verl's ``CheckpointEngineManager``, its actor workers and its ``CheckpointEngineWorker``
then drive weightbus unchanged: each update they call ``prepare`` on every rank,
``build_topology`` once, ``init_process_group``, ``send_weights`` on every actor rank and
``receive_weights`` on every rollout rank, and ``finalize``. The adapter converts where the
two contracts differ:

- verl builds an actor's engine with ``is_master`` (rank 0, or only there) and a rollout's
  without; weightbus engines learn their side from ``init_process_group`` (the ranks below
  the trainer world size are trainers), so ``is_master`` only says "an actor rank";
- ``global_steps`` becomes the update's version (the version the rollout then holds:
  ``engine.version``); ``None`` is the last version plus one;
- ``send_weights`` returns verl's metrics dict (``weightbus/seconds``, ``weightbus/gbps``,
  ...), which verl's manager merges for the trainer's logger;
- ``receive_weights`` returns weightbus's stream, an async iterator of ``(name, tensor)``
  as verl's server adapters read it (``async for``);
- ``finalize`` frees the buckets and keeps the group's rendezvous; verl forms the group
  again at every update (which is how it adds and removes replicas), and so do we.

Every actor rank walks the weights generator verl hands it (the FSDP/Megatron engine's
``get_per_tensor_param``, whose gathers are collective) and packs the buckets it owns:
with several actor ranks the weights leave from all of them (several senders), not from
rank 0 alone. On the first update the manifest is learnt by reading the generator once (its
tensors are held until that update is sent); later updates stream.

Options reach the engine through verl's ``engine_kwargs``, under the backend's name, e.g.
``checkpoint_engine.engine_kwargs={"weightbus.gloo": {"wire_dtype": "bfloat16", "timeout": 120}}``;
an option the engine does not take fails where verl builds it, naming the closest one.
"""

from __future__ import annotations

import warnings
from collections.abc import AsyncIterator, Iterable
from typing import Any, ClassVar

import torch
import verl
from verl.checkpoint_engine.base import CheckpointEngine as _VerlEngine
from verl.checkpoint_engine.base import CheckpointEngineRegistry as _VerlRegistry
from verl.checkpoint_engine.base import CheckpointEngineWithCache as _VerlEngineWithCache

from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry, UpdateStats, WeightStream
from weightbus.errors import ConfigError, PlanError, WeightSyncError
from weightbus.plan import Manifest, TensorMeta

#: weightbus backends registered in verl, as ``weightbus.<name>`` (``naive`` is verl's own
#: in-process path, which its manager runs without an engine: not registered)
BACKENDS = ("gloo", "nccl", "hccl", "nixl", "mooncake", "colocated", "shm", "disk")
PREFIX = "weightbus."

_SIDE = "_weightbus_side"  # (build_topology -> init_process_group: the rank's side)
_KEPT = "_weightbus_kept"  # (prepare -> build_topology: the group a rank holds and may keep)
#: what makes a kept group the one a new formation would meet at
_RENDEZVOUS = ("master_addr", "master_port", "token")

#: the verl versions this adapter is tested with (the ``weightbus[verl]`` extra pins them)
TESTED_VERL = ("0.9.1",)


class VerlEngine(_VerlEngine):
    """A weightbus engine under verl's ``CheckpointEngine`` contract (see the module's
    doc). ``backend`` is the weightbus backend name; the class registered in verl for it
    sets it (:func:`register`)."""

    backend: ClassVar[str] = ""
    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool | None = None,
                 wire_dtype: str | torch.dtype | None = None, **kwargs: Any) -> None:
        """``bucket_size`` and ``is_master`` as verl passes them; ``wire_dtype`` (e.g.
        ``"bfloat16"``): the dtype floating-point weights travel in, cast inside the copy
        into the bucket (an fp32 FSDP trainer then sends half the bytes; the rollout casts
        to its serving dtype anyway). ``None`` sends what verl's engine yields. The rest
        goes to the weightbus engine (``delta``, ``timeout``, ``num_buffers``, ...)."""
        if not self.backend:
            raise ConfigError("VerlEngine is abstract: use a class register() made (weightbus.<backend>)")
        self.wire_dtype = _dtype(wire_dtype)
        if kwargs.get("delta"):
            raise ConfigError(f"weightbus.{self.backend}: delta=True writes each change in place, into "
                              f"tensors the rollout rank names (set_destinations); verl's "
                              f"CheckpointEngineWorker hands its engine none (its server adapter "
                              f"loads a stream). Use weightbus's CheckpointEngineManager for delta "
                              f"updates, or leave delta out")
        # (an actor rank says so with is_master; a rollout rank says nothing: its side,
        # like an actor's rank, comes with init_process_group)
        role = "trainer" if is_master is not None else None
        self.engine: CheckpointEngine = CheckpointEngineRegistry.new(
            self.backend, bucket_size=bucket_size, role=role, **kwargs)
        self._manifest: Manifest | None = None  # learnt from the first update's weights

    # --- verl's lifecycle --------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        meta = self.engine.prepare()
        kept = self.engine.formation()
        return {**meta, _KEPT: kept} if kept is not None else meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
                       ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        engine_cls = CheckpointEngineRegistry.get(cls.backend)
        kept = [m.get(_KEPT) for m in metadata]
        metadata = [{k: v for k, v in m.items() if k != _KEPT} for m in metadata]
        actor, rollout = engine_cls.build_topology(actor_wg_world_size, rollout_world_size, metadata)
        # verl's manager forms the group before every update. When every rank still holds
        # the group it formed last, healthy and in the place this topology gives it, the
        # ranks meet at that group's rendezvous again, and an engine that keeps groups
        # (formation()) keeps it instead of forming a new one: an NCCL communicator costs
        # ~0.5 s to form, more than moving a 2 GB model. Any other difference (a rank
        # joined, left, failed or changed its buckets) reaches the engine as new arguments,
        # and it forms anew, every rank alike.
        first = kept[0]
        if first is not None and all(
                k is not None and k["rank"] == i and all(k[f] == first[f] for f in first if f != "rank")
                for i, k in enumerate(kept)):
            for side in (actor, rollout):
                for f in _RENDEZVOUS:
                    side[f] = [first[f]] * len(side[f])
        # (verl builds a rollout's engine without saying its side; the topology knows it)
        return ({**actor, _SIDE: ["trainer"] * actor_wg_world_size},
                {**rollout, _SIDE: ["rollout"] * rollout_world_size})

    def init_process_group(self, **kwargs: Any) -> None:
        side = kwargs.pop(_SIDE, None)
        if side is not None and self.engine.role is None:
            self.engine.role = side
        self.engine.init_process_group(**kwargs)

    def finalize(self) -> None:
        self.engine.finalize()

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, float]:
        source = self._source(weights)
        try:
            stats = await self.engine.send_weights(source, version=global_steps)
        except PlanError:
            # (the weights no longer match the manifest, e.g. another set of tensors: the
            # next update learns it again)
            self._manifest = None
            raise
        return metrics(stats)

    def _source(self, weights: Iterable[tuple[str, torch.Tensor]]) -> _Weights:
        """verl's generator as a weightbus source: the manifest (the wire dtype applied) is
        learnt by reading the first update's weights once; later updates stream, and the
        engine casts each tensor inside its copy into the bucket."""
        if self._manifest is not None:
            return _Weights(self._manifest, weights)
        items = list(weights)
        first = Manifest.from_tensors(items)
        self._manifest = Manifest([TensorMeta(m.name, self._wire(m.dtype), m.shape) for m in first.metas])
        return _Weights(self._manifest, items)

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        # (8-bit floats are a wire format already: kept)
        if self.wire_dtype is not None and dtype.is_floating_point and dtype.itemsize > 1:
            return self.wire_dtype
        return dtype

    def receive_weights(self, global_steps: int | None = None) -> AsyncIterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        # (verl's worker hands the result straight to its server adapter, which reads it
        # with ``async for``: an async iterator, not a coroutine; the version comes from the
        # sender)
        return _read(self.engine.receive_weights(), self.engine.where())

    # --- what weightbus adds -----------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The version this rank last completed (a rollout: the one it holds)."""
        return self.engine.version

    @property
    def last_stats(self) -> UpdateStats | None:
        return self.engine.last_stats


class VerlCacheEngine(VerlEngine, _VerlEngineWithCache):
    """A weightbus cache engine (``shm``, ``disk``) under verl's ``CheckpointEngineWithCache``:
    ``get_weights`` reads the newest cached version without the trainer (partial rollout)."""

    def get_weights(self, newer_than: int | None = None) -> WeightStream:  # type: ignore[override]
        # (the stream itself, as receive_weights: its ``.version`` says which version it is)
        return self.engine.get_weights(newer_than)  # type: ignore[attr-defined]


async def _read(stream: WeightStream, where: str) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """The stream as verl's server adapter reads it. An adapter that stops reading (it
    raised half way) drops this generator; its finalizer then fails the update on every
    rank at once, instead of the others waiting out their deadline and this rank's engine
    staying in an update that never ends."""
    finished = False
    try:
        while True:
            try:
                name, tensor = await stream.__anext__()
            except StopAsyncIteration:
                finished = True
                return
            yield name, tensor
            del tensor  # (held only by the reader: see WeightStream on views of a bucket)
    finally:
        if not finished:
            await stream.fail(WeightSyncError(f"{where}: the rollout's server adapter stopped reading "
                                              f"the update before its end"))


class _Weights:
    """A manifest and the iterable of ``(name, tensor)`` that follows it."""

    def __init__(self, manifest: Manifest, weights: Iterable[tuple[str, torch.Tensor]]):
        self.manifest = manifest
        self._weights = weights

    def __iter__(self):
        return iter(self._weights)


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"wire_dtype={value!r} is not a floating-point torch dtype (e.g. 'bfloat16')")
    return dtype


def metrics(stats: UpdateStats | None) -> dict[str, float]:
    """An update's stats as verl's metrics dict (what its manager merges for the logger)."""
    if stats is None:
        return {}
    return {f"weightbus/{k}": float(v) for k, v in stats.to_dict().items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def register(backends: Iterable[str] = BACKENDS) -> dict[str, type[VerlEngine]]:
    """Register weightbus ``backends`` in verl's registry as ``weightbus.<name>`` (done on
    import for all of them); returns the classes by verl name. Idempotent."""
    made: dict[str, type[VerlEngine]] = {}
    for name in backends:
        engine_cls = CheckpointEngineRegistry.get(name)
        cached = hasattr(engine_cls, "get_weights")
        base = VerlCacheEngine if cached else VerlEngine
        title = f"Verl{name.capitalize()}Engine"
        cls = type(title, (base,), {"backend": name, "__module__": __name__, "__qualname__": title,
                                    "__doc__": f"weightbus's {name!r} engine for verl."})
        globals()[title] = cls  # (found by name where Ray pickles it)
        _VerlRegistry.register(PREFIX + name)(cls)
        made[PREFIX + name] = cls
    return made


if getattr(verl, "__version__", None) not in TESTED_VERL:
    warnings.warn(f"weightbus.integrations.verl is tested with verl {', '.join(TESTED_VERL)}; this is verl "
                  f"{getattr(verl, '__version__', '?')}: its checkpoint-engine contract may differ",
                  stacklevel=2)

ENGINES = register()
