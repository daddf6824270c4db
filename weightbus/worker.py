"""What trainer and rollout worker classes mix in so a manager can drive them.

A trainer class provides ``weights_source()`` (e.g. ``ModuleSource(model, dtype=bf16)``);
a rollout class provides ``weights_sink()`` (e.g. ``ModuleSink(model)``) and may override
the generation hooks (``pause_generation``, ``resume_generation``, ``sleep``, ``wake_up``).
Everything named ``wb_*`` is called by :class:`weightbus.manager.CheckpointEngineManager`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import Any

from weightbus.engines.api import CheckpointEngine, CheckpointEngineRegistry
from weightbus.errors import ConfigError, ReplicasFailed, WeightbusError
from weightbus.quant import Fp8Format, QuantizedSource, module_formats
from weightbus.runtime.local import Rendezvous, connect
from weightbus.sinks import ModuleSink
from weightbus.sources import ModuleSource


class EngineHost:
    """The manager's calls that every kind of worker shares: engine set-up, group
    formation, the version held (a vLLM worker extension builds on this alone)."""

    #: version of the weights this worker fully holds (None: none, or a torn update)
    weights_version: int | None = None
    _wb_engine: CheckpointEngine | None = None
    _wb_placed: frozenset[str] = frozenset()  # tensors this rollout receives sharded, in place
    _wb_sharded = False  # it states shard destinations (placements or a Destinations)

    def wb_setup(self, backend: str, role: str, engine_kwargs: dict[str, Any],
                 replica: str | None = None) -> None:
        if self._wb_engine is not None:
            self._wb_engine.finalize(destroy_group=True)
        self._wb_engine = engine = CheckpointEngineRegistry.new(backend, role=role, **engine_kwargs)
        engine.replica = replica
        self._wb_placed: frozenset[str] = frozenset()
        self._wb_sharded = False
        placements = self.weights_placements() if role == "rollout" else None
        if placements is not None and hasattr(engine, "set_shard_destinations"):
            engine.set_shard_destinations(placements)  # (sharded receive; other engines: whole)
            self._wb_sharded = True
            # (a Destinations states its regions per update: its sink leaves out none)
            self._wb_placed = frozenset(placements) if isinstance(placements, Mapping) else frozenset()

    def weights_placements(self) -> Any:
        """A rollout that keeps only part of each tensor (tensor- or expert-parallel):
        ``{update tensor name: [(Box, destination view), ...]}`` (``weightbus.packing.shards``:
        ``tp_placements``, ``dtensor_placements``); engines that can (``gloo``, ``nccl``)
        then send it only those regions, written in place; or a
        :class:`~weightbus.engines.sharded.Destinations` that states its layout per update
        (its sink should then hold only the tensors it takes whole). None (the default):
        whole tensors."""
        return None

    def wb_connect(self, addr: str, port: int, prefix: str, rank: int, trainer_world_size: int,
                   rollout_world_size: int) -> None:
        """Form the group: prepare -> all-gather metadata on the manager's store ->
        init_process_group (rank: trainers first, then every replica's workers)."""
        assert self._wb_engine is not None, "wb_setup first"
        rdv = Rendezvous(addr, port, rank, trainer_world_size + rollout_world_size,
                         timeout=self._wb_engine.timeout, prefix=prefix)
        connect(self._wb_engine, rdv, trainer_world_size, rollout_world_size)

    # elastic engines (``mooncake``): replicas are linked to the trainers one by one
    def wb_prepare(self) -> dict[str, Any]:
        assert self._wb_engine is not None, "wb_setup first"
        return self._wb_engine.prepare()

    def wb_serve(self, rank: int, trainer_metadata: list[dict[str, Any]]) -> None:
        self._wb_engine.serve(rank, trainer_metadata)  # type: ignore[union-attr]

    def wb_link(self, add: list[tuple[str, int]], drop: list[str]) -> dict[str, str]:
        return self._wb_engine.link_replicas(add, drop)  # type: ignore[union-attr]

    def wb_attach(self, trainer_metadata: list[dict[str, Any]], link: str, rank: int, size: int) -> None:
        self._wb_engine.attach(trainer_metadata, link, rank, size)  # type: ignore[union-attr]

    def wb_links(self) -> dict[str, int]:
        """Elastic engines: the control groups this rank holds (link id -> the serial it was
        formed under), to see that a membership change left them alone."""
        return dict(getattr(self._wb_engine, "links", {}))

    def wb_connections(self) -> dict[str, int]:
        """``nixl``: the NIXL peers this rank is connected to (agent -> the serial its
        connection was made under), to see that a membership change left them alone."""
        return dict(getattr(self._wb_engine, "connections", {}))

    def wb_adopt(self, version: int, digest: int, plan: int | None = None) -> None:
        """Delta mode: this rank holds, bitwise, what a peer that applied this chain of
        patches holds (it was filled from that peer; ``plan``: a sharded group's plan the
        peer's pieces were numbered by): the next update can stay a delta."""
        engine = self._wb_engine
        if engine is not None and getattr(engine, "delta", False) and self.weights_version == version:
            chain = engine._chain  # type: ignore[attr-defined]
            chain.version, chain.digest, chain.plan = version, digest, plan
            engine.version = version

    def wb_version(self) -> int | None:
        return self.weights_version

    # serving precision (``weightbus.quant``): the rollouts say, the trainers quantize
    _wb_formats: dict[str, Any] = {}
    _wb_quantized: tuple[Any, Any] | None = None  # (the last source, its quantized wrapper)

    def wb_formats(self) -> dict[str, Any]:
        """The weights this rollout rank serves in fp8, by update name (name ->
        ``Fp8Format``). None here (a vLLM worker: its CPU build serves none);
        :class:`WeightbusWorker` reads them off its sink."""
        return {}

    def wb_set_formats(self, formats: dict[str, Any]) -> None:
        """A trainer rank: quantize these weights on the way from now on."""
        self._wb_formats, self._wb_quantized = dict(formats), None

    def wb_teardown(self) -> None:
        if self._wb_engine is not None:
            self._wb_engine.finalize(destroy_group=True)
            self._wb_engine = None


class WeightbusWorker(EngineHost):
    """Mixin for trainer and rollout workers (any runtime: local processes, Ray actors)."""

    # --- to provide ------------------------------------------------------------------------
    def weights_source(self) -> ModuleSource:
        raise NotImplementedError(f"{type(self).__name__} is a trainer: define weights_source()")

    def weights_sink(self) -> ModuleSink:
        raise NotImplementedError(f"{type(self).__name__} is a rollout: define weights_sink()")

    def weights_formats(self) -> Mapping[str, Fp8Format]:
        """A rollout: the weights it serves in fp8, by update name. By default read off
        its sink's tensors (:func:`weightbus.quant.module_formats`: an fp8 ``...weight``
        with its scale beside it); a sink with a ``name_map`` must say them here."""
        sink = self.weights_sink()
        formats = module_formats(sink.targets)
        if formats and sink.name_map is not None:
            raise ConfigError(f"{type(self).__name__}: the sink maps names and holds fp8 weights "
                              f"({next(iter(formats))!r}...): define weights_formats() by update name")
        return formats

    def wb_formats(self) -> dict[str, Any]:
        return dict(self.weights_formats())

    # --- hooks a rollout may override --------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> None:
        """Stop generating before an update: ``abort`` in-flight requests, or ``keep``
        them paused, or ``wait`` for them."""

    def resume_generation(self) -> None:
        """Generate again (with the new weights)."""

    def sleep(self) -> None:
        """Release rollout memory while the trainer trains (hybrid)."""

    def wake_up(self) -> None:
        """Restore rollout memory before the weights arrive (hybrid)."""

    # --- driven by the manager ----------------------------------------------------------------
    async def wb_send(self, version: int, rollback: bool = False) -> dict[str, Any]:
        assert self._wb_engine is not None, "wb_setup first"
        try:
            source: Any = self._quantized(self.weights_source())
        except Exception as e:  # noqa: BLE001 - every rank hears it at the header, at once
            source = _Unavailable(e)
        failed: dict[str, str] = {}
        try:
            stats = await self._wb_engine.send_weights(source, version=version, rollback=rollback)
        except ReplicasFailed as e:  # an elastic engine reached the others: the manager sorts it out
            stats, failed = e.stats, e.failed  # type: ignore[assignment]
        self.weights_version = version
        return {"seconds": stats.seconds, "bytes": stats.bytes, "tensors": stats.tensors, "failed": failed,
                "wire_bytes": stats.wire_bytes, "full": getattr(self._wb_engine, "last_full", None)}

    def _quantized(self, source: Any) -> Any:
        """``source`` with the weights the rollouts serve in fp8 quantized on the way (the
        same wrapper while the source is the same object: its GPU launches are kept)."""
        if not self._wb_formats:
            return source
        last = self._wb_quantized
        if last is None or last[0] is not source:
            cache = last[1].launches if last is not None else None
            last = self._wb_quantized = (source, QuantizedSource(source, self._wb_formats, launches=cache))
        return last[1]

    async def wb_receive(self, version: int) -> dict[str, Any]:
        assert self._wb_engine is not None, "wb_setup first"
        engine = self._wb_engine
        start = time.perf_counter()
        sink = self.weights_sink()
        if self._wb_placed:  # sharded: the placed tensors land in place; the sink takes the rest
            placed = {sink.name_map(n) if sink.name_map else n for n in self._wb_placed}
            sink = ModuleSink({n: t for n, t in sink.targets.items() if n not in placed}, strict=sink.strict,
                              allow_cast=sink.allow_cast, name_map=sink.name_map)
        if getattr(engine, "delta", False) and engine._dest is None:
            engine.set_destinations(sink.targets)  # delta mode patches in place
        stream = engine.receive_weights()
        try:
            report = await sink.load(stream)
        except BaseException as e:
            # a sink that raised without closing the stream would leave the update open on
            # this rank: the others would wait out their deadline, and the next update would
            # find this one still under way. Closed, it ends now on every rank, naming e.
            with contextlib.suppress(Exception):
                await stream.fail(e)
            # untouched (the update failed before a byte was written): the old version
            # stands; otherwise this worker holds no whole version
            held = engine.version
            self.weights_version = held if held is not None and held != version else None
            raise
        if engine.version != version:
            self.weights_version = None
            raise RuntimeError(f"received version {engine.version}, expected {version}")
        self.weights_version = version
        got = engine.last_stats.bytes if self._wb_sharded and engine.last_stats else report.bytes
        return {"seconds": time.perf_counter() - start, "bytes": got, "tensors": report.loaded}


    async def wb_pull(self, mode: str = "abort") -> int | None:
        """Cache engines (fully-async): take the newest published version if it is newer
        than what this worker holds (generation paused only while it loads); returns the
        version held."""
        engine = self._wb_engine
        assert engine is not None, "wb_setup first"
        if not hasattr(engine, "get_weights"):
            raise WeightbusError(f"backend {engine.backend!r} keeps no cache to pull from: use 'shm' "
                                 f"or 'disk'")
        stream = engine.get_weights(newer_than=self.weights_version)
        if stream.version is None:  # type: ignore[attr-defined]
            return self.weights_version
        self.pause_generation(mode)
        try:
            self.weights_version = None
            await self.weights_sink().load(stream)
            self.weights_version = stream.version  # type: ignore[attr-defined]
        finally:
            self.resume_generation()
        return self.weights_version

    # --- join from a peer (no trainer involved) ------------------------------------------------
    async def wb_peer_send(self, addr: str, port: int, prefix: str, timeout: float,
                           backend: str = "gloo") -> dict[str, Any]:
        """A rank of a replica that holds the current version sends its own weights to the
        joining replica's rank of the same index, over a group of those two (its
        generation goes on; its weights change only in an update, which the manager does
        not run meanwhile)."""
        if self.weights_version is None:
            raise WeightbusError("this replica holds no whole version to give a joiner")
        engine = CheckpointEngineRegistry.new(backend, role="trainer", timeout=timeout)
        try:
            connect(engine, Rendezvous(addr, port, 0, 2, timeout=timeout, prefix=prefix), 1, 1)
            source = ModuleSource(dict(self.weights_sink().targets))
            stats = await engine.send_weights(source, version=self.weights_version)
        finally:
            engine.finalize(destroy_group=True)
        chain = getattr(self._wb_engine, "_chain", None)  # delta mode: what the joiner holds too
        held = (chain.version, chain.digest, chain.plan) if chain is not None and chain.version is not None \
            else None
        return {"version": stats.version, "bytes": stats.bytes, "seconds": stats.seconds, "chain": held}

    async def wb_peer_receive(self, addr: str, port: int, prefix: str, timeout: float,
                              backend: str = "gloo") -> dict[str, Any]:
        """A joining replica's rank: the weights (and version) of the peer's rank of the
        same index, straight into this rank's tensors."""
        targets = dict(self.weights_sink().targets)
        engine = CheckpointEngineRegistry.new(backend, role="rollout", timeout=timeout)
        engine.set_destinations(targets)
        self.weights_version = None
        try:
            connect(engine, Rendezvous(addr, port, 1, 2, timeout=timeout, prefix=prefix), 1, 1)
            report = await ModuleSink(targets).load(engine.receive_weights())
        finally:
            engine.finalize(destroy_group=True)
        self.weights_version = engine.version
        return {"version": engine.version, "bytes": report.bytes, "tensors": report.loaded, "seconds": 0.0}


class _Unavailable:
    """Stands in for a trainer's source that could not be made: the update aborts at its
    header on every rank, naming why, instead of the rollouts waiting out their deadline."""

    def __init__(self, error: BaseException):
        self.error = error

    @property
    def manifest(self) -> Any:
        raise WeightbusError(f"weights_source() raised {type(self.error).__name__}: {self.error}")
