"""Layer 3, the public engine API: what a user or a framework programs against.

- :class:`CheckpointEngine`, the lifecycle every backend implements (prepare ->
  build_topology -> init_process_group -> send_weights / receive_weights -> finalize), and
  :class:`CheckpointEngineWithCache` for engines that also serve ``get_weights``;
- :class:`CheckpointEngineRegistry`, backends by name;
- :class:`WeightStream`, what ``receive_weights`` returns; :class:`UpdateStats`, what an
  update reports; the :class:`WeightSource` protocol, what ``send_weights`` takes.

How bucket engines move bytes lives one module over (:mod:`weightbus.engines.bucket`), how
a sender reads its weights in :mod:`weightbus.engines.streams`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import gc
import inspect
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from weightbus import config
from weightbus.errors import ConfigError, PlanError, WeightbusError, WeightSyncError
from weightbus.packing import buffers
from weightbus.plan import ALIGNMENT, TRAILER_BYTES, Manifest

Role = Literal["trainer", "rollout"]


_gc_lock = threading.Lock()
_gc_depth = 0  # updates under way in this process that paused the collector
_gc_was_on = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration of an update (of every update
    under way in this process; ``WEIGHTBUS_GC_PAUSE=0``: left alone), on again after the
    last one if it was on before. An update makes and drops tensor objects by the thousand
    (views, pieces, their tables): each collection of the oldest generation walks every
    object the process holds, a model's tensors included, and on 20,000 tensors from two
    FSDP2 ranks took more time than the update's own work (RESULTS, "Delta, round ten").
    Objects freed by reference counts go as ever; cycles made meanwhile wait for the next
    collection."""
    global _gc_depth, _gc_was_on
    if not config.flag("WEIGHTBUS_GC_PAUSE", True):
        yield
        return
    with _gc_lock:
        if _gc_depth == 0:
            _gc_was_on = gc.isenabled()
            gc.disable()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0 and _gc_was_on:
                gc.enable()


def paused_steps(inner: Iterator[Any]) -> Iterator[Any]:
    """``inner``'s items, the collector paused (:func:`_gc_paused`) while ``inner`` makes
    each one and while it finishes, never while the consumer holds them: a consumer that
    never closes the stream cannot leave it paused. Closed, it closes ``inner`` (which then
    completes the update without yielding, as a receive does)."""
    while True:
        with _gc_paused():
            try:
                item = next(inner)
            except StopIteration:
                return
        try:
            yield item
        except GeneratorExit:
            with _gc_paused():
                inner.close()
            raise


@runtime_checkable
class WeightSource(Protocol):
    """What ``send_weights`` takes besides a plain iterable of ``(name, tensor)`` pairs:
    a source that knows its manifest up front (:class:`weightbus.sources.ModuleSource`,
    :class:`weightbus.integrations.hf.HFCheckpointSource`, a Megatron or checkpoint source
    of your own). Every trainer rank iterates the same source in lockstep.

    - ``manifest``: every tensor's rollout-side name, *wire* dtype and full shape, in the
      order iteration yields them (a tensor may be yielded in another floating dtype: the
      engine casts it once, inside the copy into the bucket);
    - ``__iter__``: ``(name, full tensor)`` in manifest order;
    - optionally ``iter_for(owners, rank, into=None)``: the same, but a rank that is not in
      ``owners(i)`` may yield ``None`` for tensor ``i`` instead of materialising it
      (sharded tensors are gathered only to the ranks that pack them); ``into(i)``, where
      given, names a tensor to write tensor ``i`` into (direct mode);
    - optionally ``plain_tensors()``: every tensor in manifest order as a list (or None),
      so the engine packs with no per-tensor step (asked when an engine first wants it);
    - optionally ``direct_writer(dests)``: a function that writes every tensor, in manifest
      order, straight into ``dests`` and says whether it could (colocated direct mode
      hands it the rollout's own tensors: :class:`weightbus.quant.QuantizedSource`
      quantizes into them, with no copy of the model between).
    """

    manifest: Manifest

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


#: ``(name, tensor)`` pairs, or a :class:`WeightSource`.
Weights = Iterable[tuple[str, torch.Tensor]]
#: Checks an incoming update's manifest before any tensor is consumed; raises to reject it.
Validator = Callable[[Manifest], None]
#: Runs once the consumer has every tensor, before the ranks agree on the outcome; raises
#: to fail the update on every rank (a post-load check of the rollout model).
Completion = Callable[[], None]



@dataclass
class UpdateStats:
    """What one update moved and how long it took, on one rank."""

    version: int  # the version every rank now holds
    tensors: int  # tensors in the update (its manifest)
    bytes: int  # payload bytes delivered (wire dtype): the whole model, delta or not (a
    #            sharded receive: the bytes of this rank's regions and whole tensors)
    wire_bytes: int  # bytes that crossed the link on this rank's buckets, trailers included
    seconds: float  # from the call to the agreed outcome, on this rank
    buckets: int  # buckets this update took (a delta update: those of its records)
    #: delta mode (``delta=True``): True when the update went as the changes since the
    #: version the receivers held, False when it went whole (the first update, a resync
    #: after a failure or a drift, a receiver that held another version); None: not delta mode
    delta: bool | None = None
    #: a sharded receive (a rollout rank that stated its layout): how many tensors it took
    #: whole because its layout did not name them (its sink loaded them whole); None otherwise
    fallbacks: int | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict, for a framework's metrics or logs."""
        return {**dataclasses.asdict(self), "gbps": self.gbps}


Batch = list[tuple[str, torch.Tensor]]


class WeightStream:
    """What ``receive_weights()`` returns: an async iterator of ``(name, tensor)``, one
    item per tensor, which also hands out its tensors a bucket at a time
    (:meth:`batches`) to a consumer that can take them so (:class:`ModuleSink` does): for
    a model of 100k small tensors the per-tensor step costs more than the bytes.

    Read it one way, to the end, or close it (``aclose``, or ``contextlib.aclosing``): an
    update is complete only when its consumer has taken every tensor.

    Read item by item, every tensor stays valid as long as the consumer holds it
    (``{n: t async for n, t in stream}`` holds the whole model): a tensor that is a view of
    a bucket the engine is about to fill again is copied out at that moment if the consumer
    still holds it (a reference count; at most the last tensor of each bucket, held by the
    loop's own variable, is copied without need). In :meth:`batches`, which copies nothing,
    a bucket's tensors are valid until the next batch is asked for.
    """

    def __init__(self, batches: Iterator[Batch] | AsyncIterator[Batch]):
        self._batches = batches
        self._items: Iterator[tuple[str, torch.Tensor]] = iter(())
        self._lent: list[torch.Tensor] | None = None  # the aliases handed out of a Lent batch
        #: why the consumer gave up, where it said so (:meth:`fail`): every rank hears it
        self.failure: str | None = None

    def __aiter__(self) -> WeightStream:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        while True:
            for item in self._items:
                if self._lent is None:
                    return item
                alias = item[1].view(item[1].shape)  # (its own object: whether the consumer holds it shows)
                self._lent.append(alias)
                return item[0], alias
            self._keep_held()
            batch = await self._next_batch()
            self._lent = [] if isinstance(batch, buffers.Lent) else None
            self._items = iter(batch)

    def _keep_held(self) -> None:
        """Before the engine fills the last batch's slot again: the tensors the consumer
        still holds (a reference besides the list's, the loop's and ``getrefcount``'s) get a
        copy of their bytes of their own, in place (the consumer's objects stay the same)."""
        lent, self._lent = self._lent, None
        if not lent:
            return
        with torch.no_grad():
            for alias in lent:
                if sys.getrefcount(alias) > 3:
                    alias.set_(alias.clone())

    async def _next_batch(self) -> Batch:
        if isinstance(self._batches, AsyncIterator):
            return await self._batches.__anext__()
        try:
            return next(self._batches)
        except StopIteration:
            raise StopAsyncIteration from None

    async def batches(self) -> AsyncIterator[Batch]:
        """The tensors a bucket at a time: lists of ``(name, tensor)``, valid until the next
        list is asked for. A list that is the same object as one of an earlier update
        holds the same tensors (the engine wrote them in place both times)."""
        try:
            while True:
                try:
                    batch = await self._next_batch()
                except StopAsyncIteration:
                    return
                yield batch
        except BaseException as e:
            self.failure = self.failure or _why(e)
            raise
        finally:
            await self.aclose()

    async def fail(self, error: BaseException) -> None:
        """Stop reading because of ``error`` (the consumer's own failure): the update fails
        on every rank now, each naming ``error``, instead of the others waiting out their
        deadline for a consumer that is gone."""
        self.failure = self.failure or _why(error)
        await self.aclose()

    async def aclose(self) -> None:
        """Stop reading: an update not read to the end fails on every rank."""
        if isinstance(self._batches, AsyncIterator):
            close = getattr(self._batches, "aclose", None)
            if close is not None:
                await close()
        else:
            close = getattr(self._batches, "close", None)
            if close is not None:
                close()


def _why(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


class CheckpointEngine(ABC):
    """Moves one version of the weights from trainer ranks to rollout ranks.

    Lifecycle (the seed API)::

        meta = engine.prepare()                                    # every rank
        t_kw, r_kw = Engine.build_topology(T, R, [metas...])       # anywhere
        engine.init_process_group(**{k: v[rank] for k, v in kw.items()})
        await engine.send_weights(stream)                          # trainer ranks
        async for name, t in engine.receive_weights(): ...         # rollout ranks
        engine.finalize()

    ``metadata`` passed to :meth:`build_topology` lists the trainer ranks' metadata
    first (trainer rank order), then the rollout ranks'.
    """

    #: registry name this instance was made under (``gloo``, ``nccl``, ``colocated``...)
    backend: str = ""
    #: rollout side: the replica this rank serves in (any name its ranks share; the
    #: manager sets it). Backends that relay inside a replica (``mooncake``) group by it.
    replica: str | None = None

    def __init__(self, bucket_size: int | None = None, *, device: str | torch.device | None = None,
                 num_buffers: int = 2, timeout: float | None = None, role: Role | None = None):
        # every option is checked here, where it is given, not deep in an update
        self._bucket_size = config.bucket_size(bucket_size, alignment=ALIGNMENT, trailer=TRAILER_BYTES)
        self.num_buffers = config.integer(num_buffers, "num_buffers", minimum=1, maximum=64)
        self.timeout = config.timeout(timeout)
        if role not in (None, "trainer", "rollout"):
            raise PlanError(f"role must be 'trainer' or 'rollout', got {role!r}")
        try:
            self.device = torch.device(device) if device is not None else _default_device()
        except (RuntimeError, TypeError) as e:
            raise PlanError(f"device={device!r} is not a device: {e}") from None
        self.role: Role | None = role
        #: version of the last update this engine completed (sent or fully received);
        #: None on a receiver whose last update failed after it began writing: what it
        #: holds may be part old, part new (torn) until an update completes
        self.version: int | None = 0
        self.last_stats: UpdateStats | None = None
        self._dest: dict[str, torch.Tensor] | None = None
        self._busy: dict[str, bool] = {}  # direction -> an update is under way
        self._broken: str | None = None  # why the group cannot be used any more

    @property
    def broken(self) -> str | None:
        """Why the group can no longer carry updates (a peer lost, a deadline passed), or
        None while it can: form it again (``init_process_group``) before the next update."""
        return self._broken

    @property
    def bucket_size(self) -> int:
        if self._bucket_size is None:
            self._bucket_size = buffers.default_bucket_size(self.device)
        return self._bucket_size

    @abstractmethod
    def prepare(self) -> dict[str, Any]:
        """Allocate buffers and open endpoints; returns metadata for build_topology."""

    @classmethod
    @abstractmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list], dict[str, list]]:
        """Per-rank keyword arguments of init_process_group: ``(trainer, rollout)``, each
        a dict of lists indexed by rank within its side."""

    @abstractmethod
    def init_process_group(self, **kwargs: Any) -> None:
        """Form (or re-form) the group; may be kept across updates."""

    @abstractmethod
    async def send_weights(self, weights: Weights, *, version: int | None = None,
                           rollback: bool = False) -> UpdateStats:
        """Send one version; every trainer rank calls it with the same ordered stream. A
        version lower than the one the group last agreed on (or that a rollout rank
        serves) fails on every rank before a byte moves, naming both versions, unless
        ``rollback`` says it is meant."""

    @abstractmethod
    def receive_weights(self, *, expected: Manifest | None = None) -> WeightStream:
        """Every tensor of one version, once, as a :class:`WeightStream` (an async iterator
        of ``(name, tensor)``). A yielded tensor may be a view of a bucket: valid until the
        next iteration. With ``expected``, an update whose manifest differs fails on every
        rank before any tensor is yielded."""

    @abstractmethod
    def finalize(self, destroy_group: bool = False) -> None:
        """Free buckets; with ``destroy_group`` also drop the group."""

    def formation(self) -> dict[str, Any] | None:
        """The ``init_process_group`` arguments of the group this rank is in, while it may
        be kept (formed, and no update broke it since); ``None`` otherwise. An engine that
        returns them keeps its group when ``init_process_group`` is called with the same
        arguments again (verl's manager forms the group before every update)."""
        return None

    def set_destinations(self, named: Any) -> None:
        """Rollout side: write received tensors straight into these (name -> tensor) where
        name, dtype and shape match, instead of yielding views of a bucket: no temporary
        for split tensors and no second copy in the sink, which sees the tensor in place."""
        self._dest = dict(named)

    def where(self) -> str:
        return f"{self.backend or type(self).__name__} {self.role or '?'} rank {getattr(self, 'rank', '?')}"

    @contextlib.contextmanager
    def _exclusive(self, direction: str) -> Iterator[None]:
        """One update at a time per direction: a second one started while the first runs
        would interleave with its messages and corrupt both. A send pauses Python's cyclic
        garbage collector meanwhile (:func:`_gc_paused`: a send runs no code of the caller's
        but its source's); a receive hands each tensor to its consumer, and pauses it only
        while it works itself (:func:`paused_steps`)."""
        if self._busy.get(direction):
            raise WeightSyncError(f"{self.where()}: {direction} started while another {direction} is "
                                  f"still under way on this engine; finish (await or exhaust) the "
                                  f"first one before the next update")
        self._busy[direction] = True
        try:
            with _gc_paused() if direction == "send_weights" else contextlib.nullcontext():
                yield
        finally:
            self._busy[direction] = False

    def _next_version(self, version: Any, rollback: bool = False) -> int:
        """The version a send carries: the one given (checked), else one more than the last.
        One lower than the last is a :class:`ConfigError` unless ``rollback`` says it is meant."""
        if version is None:
            return config.version((self.version or 0) + 1, "the next version (the last one plus 1)")
        version = config.version(version)
        if not rollback and self.version is not None and version < self.version:
            raise ConfigError(f"version {version} is lower than version {self.version}, the last one sent: "
                              f"pass rollback=True to send an older version; nothing was sent")
        return version

    def buffer_metadata(self) -> dict[str, Any]:
        """This rank's say in the bucket size and count (see :func:`agree_buffers`)."""
        return {"bucket_size": self._bucket_size, "bucket_fit": self.bucket_size,
                "num_buffers": self.num_buffers, "alignment": ALIGNMENT,
                "delta": getattr(self, "delta", False)}


def check_sides(trainer_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]) -> None:
    """What every ``build_topology`` needs: both sides present, one metadata entry per rank."""
    T, R = trainer_world_size, rollout_world_size
    if T < 1 or R < 1:
        raise PlanError(f"need at least one trainer and one rollout rank, got {T} and {R}")
    if len(metadata) != T + R:
        raise PlanError(f"metadata has {len(metadata)} entries for {T}+{R} ranks")


def agree_buffers(trainer_world_size: int, metadata: list[dict[str, Any]], *, size: bool = True) -> int:
    """The bucket size every rank of a group uses, from every rank's metadata: the size
    ranks were given explicitly (they must all agree), else the smallest that fits every
    rank's free memory. Ranks must agree on the number of buffers and on delta mode too
    (``size=False``: only on those, where one side's slots set the size). A disagreement is
    one error, raised on every rank as the group forms, naming the ranks and their values
    (not a shape error on one side and a timeout on the other)."""
    def who(i: int) -> str:
        return f"trainer rank {i}" if i < trainer_world_size else f"rollout rank {i - trainer_world_size}"

    fix = {"alignment": "; run the same weightbus version on every rank",
           "bucket_size": "; give every rank the same bucket_size (or none: the smallest that fits "
                          "every rank is then used)",
           "delta": "; give every rank the same delta= (patches need every rank in delta mode)"}
    for key in ("bucket_size", "num_buffers", "alignment", "delta")[0 if size else 1:]:
        given = {i: m[key] for i, m in enumerate(metadata) if m.get(key) is not None}
        if len(set(given.values())) > 1:
            raise PlanError(f"the ranks disagree on {key}: "
                            + ", ".join(f"{who(i)} has {v}" for i, v in given.items())
                            + fix.get(key, f"; give every rank the same {key}"))
    explicit = [m["bucket_size"] for m in metadata if m.get("bucket_size")]
    if explicit:
        return int(explicit[0])
    fits = [int(m["bucket_fit"]) for m in metadata if m.get("bucket_fit")]
    return min(fits) if fits else buffers.default_bucket_size(torch.device("cpu"))


class CheckpointEngineWithCache(CheckpointEngine):
    """An engine that keeps the latest version where a rollout can pull it on its own."""

    @abstractmethod
    def get_weights(self, newer_than: int | None = None) -> WeightStream:
        """The newest cached version newer than ``newer_than``, at once: a stream whose
        ``.version`` says which (``None``, and nothing in it, when there is none newer)."""


class CheckpointEngineRegistry:
    """Backends by name: ``CheckpointEngineRegistry.new("gloo", bucket_size=...)``."""

    _engines: ClassVar[dict[str, tuple[type[CheckpointEngine], dict[str, Any]]]] = {}

    @classmethod
    def register(cls, name: str, **defaults: Any
                 ) -> Callable[[type[CheckpointEngine]], type[CheckpointEngine]]:
        """Class decorator; stack it to register one class under several names, each
        with its own constructor defaults."""

        def deco(engine_cls: type[CheckpointEngine]) -> type[CheckpointEngine]:
            if name in cls._engines and cls._engines[name][0] is not engine_cls:
                raise WeightbusError(f"checkpoint engine {name!r} is already registered "
                                     f"to {cls._engines[name][0].__qualname__}")
            cls._engines[name] = (engine_cls, defaults)
            return engine_cls

        return deco

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._engines)

    @classmethod
    def get(cls, name: str) -> type[CheckpointEngine]:
        return cls._lookup(name)[0]

    @classmethod
    def _lookup(cls, name: str) -> tuple[type[CheckpointEngine], dict[str, Any]]:
        try:
            return cls._engines[name]
        except KeyError:
            import difflib
            close = difflib.get_close_matches(str(name), cls.names(), n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise WeightbusError(f"unknown checkpoint engine backend {name!r}; registered: "
                                 f"{', '.join(cls.names())}{hint}") from None

    @classmethod
    def options(cls, name: str) -> list[str]:
        """The keyword arguments backend ``name``'s engine takes (its class's and every
        base's: engines hand the rest on with ``**kwargs``)."""
        engine_cls = cls._lookup(name)[0]
        names: list[str] = []
        for klass in engine_cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or klass is object:
                continue
            for p in inspect.signature(init).parameters.values():
                named = p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                if named and p.name != "self" and p.name not in names:
                    names.append(p.name)
        return names

    @classmethod
    def check_options(cls, name: str, kwargs: dict[str, Any]) -> None:
        """Refuse keyword arguments backend ``name`` does not take, naming the closest it
        does (a misspelled ``bucket_sise`` must not surface as a bare TypeError, or later
        in a worker process)."""
        known = cls.options(name)
        for key in kwargs:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ConfigError(f"backend {name!r} takes no option {key!r}; {hint}its options: "
                                  f"{', '.join(known)}")

    @classmethod
    def new(cls, name: str, **kwargs: Any) -> CheckpointEngine:
        engine_cls, defaults = cls._lookup(name)
        cls.check_options(name, kwargs)
        engine = engine_cls(**{**defaults, **kwargs})
        engine.backend = name
        return engine


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
