"""Layer 3: the engine API, the registry, and the update protocol every bucket engine
shares.

An update on the wire, for every engine built on :class:`BucketEngine`::

    header   control group, from the sender root: magic, version, fingerprint, status,
             and the manifest itself only when the group has not seen this fingerprint
    buckets  per the BucketPlan; each bucket's trailer carries its status, so a sender
             that failed still sends its buckets, as abort notices with its error text
    finish   control group: all-reduce of every rank's status; if any rank failed, its
             message is broadcast and every rank raises the same WeightSyncError

Every rank therefore issues the same sequence of operations whatever fails, so no rank
is left blocked; a peer that dies or hangs trips the group's deadline instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import torch

from weightbus import buffers, comm, config
from weightbus.engines import delta as delta_mode
from weightbus.errors import PlanError, TransferFailed, WeightbusError, WeightSyncError
from weightbus.plan import ALIGNMENT, TRAILER_BYTES, Bucket, BucketPlan, Manifest, TensorMeta

Role = Literal["trainer", "rollout"]
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
      so the engine packs with no per-tensor step.
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

_log = logging.getLogger("weightbus")
_HEADER_WORDS = 8
_MESSAGE_BYTES = 4096


@dataclass
class UpdateStats:
    """What one update moved and how long it took, on one rank."""

    version: int
    tensors: int
    bytes: int  # payload bytes delivered (wire dtype)
    wire_bytes: int  # bytes that crossed the link on this rank's buckets, trailers included
    seconds: float
    buckets: int

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
    update is complete only when its consumer has taken every tensor. A tensor that is a
    view of a bucket is valid until the next item (or batch) is asked for.
    """

    def __init__(self, batches: Iterator[Batch] | AsyncIterator[Batch]):
        self._batches = batches
        self._items: Iterator[tuple[str, torch.Tensor]] = iter(())

    def __aiter__(self) -> WeightStream:
        return self

    async def __anext__(self) -> tuple[str, torch.Tensor]:
        while True:
            for item in self._items:
                return item
            self._items = iter(await self._next_batch())

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
        finally:
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
    async def send_weights(self, weights: Weights, *, version: int | None = None) -> UpdateStats:
        """Send one version; every trainer rank calls it with the same ordered stream."""

    @abstractmethod
    def receive_weights(self, *, expected: Manifest | None = None) -> WeightStream:
        """Every tensor of one version, once, as a :class:`WeightStream` (an async iterator
        of ``(name, tensor)``). A yielded tensor may be a view of a bucket: valid until the
        next iteration. With ``expected``, an update whose manifest differs fails on every
        rank before any tensor is yielded."""

    @abstractmethod
    def finalize(self, destroy_group: bool = False) -> None:
        """Free buckets; with ``destroy_group`` also drop the group."""

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
        would interleave with its messages and corrupt both."""
        if self._busy.get(direction):
            raise WeightSyncError(f"{self.where()}: {direction} started while another {direction} is "
                                  f"still under way on this engine; finish (await or exhaust) the "
                                  f"first one before the next update")
        self._busy[direction] = True
        try:
            yield
        finally:
            self._busy[direction] = False

    def _next_version(self, version: Any) -> int:
        """The version a send carries: the one given (checked), else one more than the last."""
        if version is None:
            return (self.version or 0) + 1
        return config.version(version)

    def buffer_metadata(self) -> dict[str, Any]:
        """This rank's say in the bucket size and count (see :func:`agree_buffers`)."""
        return {"bucket_size": self._bucket_size, "bucket_fit": self.bucket_size,
                "num_buffers": self.num_buffers, "alignment": ALIGNMENT}


def check_sides(trainer_world_size: int, rollout_world_size: int, metadata: list[dict[str, Any]]) -> None:
    """What every ``build_topology`` needs: both sides present, one metadata entry per rank."""
    T, R = trainer_world_size, rollout_world_size
    if T < 1 or R < 1:
        raise PlanError(f"need at least one trainer and one rollout rank, got {T} and {R}")
    if len(metadata) != T + R:
        raise PlanError(f"metadata has {len(metadata)} entries for {T}+{R} ranks")


def agree_buffers(trainer_world_size: int, metadata: list[dict[str, Any]]) -> int:
    """The bucket size every rank of a group uses, from every rank's metadata: the size
    ranks were given explicitly (they must all agree), else the smallest that fits every
    rank's free memory. Ranks must agree on the number of buffers too. A disagreement is
    one error naming the ranks and their values (not a shape error on one side and a
    timeout on the other)."""
    def who(i: int) -> str:
        return f"trainer rank {i}" if i < trainer_world_size else f"rollout rank {i - trainer_world_size}"

    for key in ("bucket_size", "num_buffers", "alignment"):
        given = {i: m[key] for i, m in enumerate(metadata) if m.get(key) is not None}
        if len(set(given.values())) > 1:
            raise PlanError(f"the ranks disagree on {key}: "
                            + ", ".join(f"{who(i)} has {v}" for i, v in given.items())
                            + (f"; give every rank the same {key}" if key != "alignment" else
                               "; run the same weightbus version on every rank")
                            + (" (or none: the smallest that fits every rank is then used)"
                               if key == "bucket_size" else ""))
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
            raise WeightbusError(f"unknown checkpoint engine backend {name!r}; registered: "
                                 f"{', '.join(cls.names())}") from None

    @classmethod
    def new(cls, name: str, **kwargs: Any) -> CheckpointEngine:
        engine_cls, defaults = cls._lookup(name)
        engine = engine_cls(**{**defaults, **kwargs})
        engine.backend = name
        return engine


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ------------------------------------------------------------------ weight streams


class _Stream:
    """The sender's view of one update's weights: a manifest plus an iterator that yields
    ``(name, tensor)`` in manifest order (tensor ``None`` where this rank need not hold it)."""

    def __init__(self, manifest: Manifest, open_: Callable[..., Iterator[tuple[str, torch.Tensor | None]]],
                 strict_dtype: bool, tensors: list[torch.Tensor] | None = None):
        self.manifest = manifest
        self.open = open_
        self.strict_dtype = strict_dtype
        #: every tensor, in manifest order, where the source holds them all as plain
        #: tensors: the sender then packs with no per-tensor step at all
        self.tensors = tensors
        #: the source object, where there is one (delta mode asks it for local pieces)
        self.source: Any = None

    def checked_tensors(self, checked_before: list[torch.Tensor] | None = None) -> list[torch.Tensor] | None:
        """:attr:`tensors`, once checked against the manifest in bulk (a mismatch names the
        tensor), or None where the source has no such list. ``checked_before`` is the list
        this engine checked on its last update: the same list object (a source that holds
        its tensors by reference) against the same manifest is not checked again."""
        if self.tensors is None:
            return None
        if self.tensors is checked_before:
            return self.tensors
        metas = self.manifest.metas
        tensors = self.tensors
        if len(tensors) != len(metas):
            raise PlanError(f"the weight source holds {len(tensors)} tensors, its manifest {len(metas)}")
        # in bulk: one list comparison for the shapes, and castability per distinct pair of
        # dtypes (it depends on nothing else); the per-tensor check runs only to name a culprit
        bad = [t.shape for t in tensors] != self.manifest.shapes
        for have, want in {(t.dtype, m.dtype) for t, m in zip(tensors, metas, strict=True)}:
            if have is not want and not (have.is_floating_point and want.is_floating_point):
                bad = True
        if bad:
            for t, m in zip(tensors, metas, strict=True):
                buffers.check_castable(m, t)
        return tensors


def resolve_stream(weights: Any, cached: Manifest | None) -> _Stream:
    """Find the manifest of ``weights`` without materialising it where possible.

    - a source with a ``manifest`` (``weightbus.sources``) says it; if it also has
      ``iter_for(owners, rank)`` only the ranks that pack a tensor materialise it;
    - a plain iterable is assumed to match the previous update's manifest and is checked
      tensor by tensor as it streams;
    - a plain iterable on the first update is read once to learn its manifest.
    """
    manifest = getattr(weights, "manifest", None)
    if isinstance(manifest, Manifest):
        if hasattr(weights, "iter_for"):
            def open_(plan: Any, owners: Any, rank: int, into: Any = None) -> Any:
                if into is not None:
                    return weights.iter_for(owners, rank, into=into)
                return weights.iter_for(owners, rank)
            plain = getattr(weights, "plain_tensors", None)
            stream = _Stream(manifest, open_, False, plain() if plain is not None else None)
            stream.source = weights
            return stream
        return _Stream(manifest, lambda plan, owners, rank: iter(weights), False)
    if isinstance(weights, Mapping):
        raise PlanError(f"the weights are a {type(weights).__name__} of {len(weights)} entries; pass "
                        f"ModuleSource(weights) (the dtype policy, sharded tensors, no per-tensor "
                        f"steps) or weights.items()")
    if isinstance(weights, torch.Tensor | str | bytes) or not isinstance(weights, Iterable):
        raise PlanError(f"the weights must be a source (ModuleSource) or an iterable of (name, tensor) "
                        f"pairs, got {type(weights).__name__}")
    if cached is not None:
        return _Stream(cached, lambda plan, owners, rank: iter(weights), True)
    items = list(weights)
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], torch.Tensor)):
            raise PlanError(f"the weight stream must yield (name, tensor) pairs, got {type(item).__name__} "
                            f"{str(item)[:60]!r}; a dict of tensors goes in ModuleSource(d) or d.items()")
    return _Stream(Manifest.from_tensors(items), lambda plan, owners, rank: iter(items), True)


def fetch(it: Iterator[tuple[str, torch.Tensor | None]], meta: TensorMeta, position: int,
           strict_dtype: bool) -> torch.Tensor | None:
    try:
        name, t = next(it)
    except StopIteration:
        raise PlanError(f"the weight stream ended early: it has no tensor {meta.describe()} "
                        f"(position {position})") from None
    except Exception as e:  # noqa: BLE001 - the user's iterator is dead now
        raise StreamBroken(e) from e
    if name != meta.name:
        raise PlanError(f"the weight stream gives {name!r} where the manifest has "
                        f"{meta.describe()} (position {position})")
    if t is None:
        return None
    if t.dtype is not meta.dtype:
        buffers.check_castable(meta, t)
        if strict_dtype:
            raise PlanError(f"tensor {name!r} changed dtype from {meta.dtype} to {t.dtype} since the "
                            f"manifest was taken; pass a source with a manifest to cast")
    elif t.shape != meta.shape:
        buffers.check_castable(meta, t)
    return t


class StreamBroken(Exception):
    """The user's iterator raised: it cannot be advanced any more."""


# ------------------------------------------------------------------ the shared protocol


class BucketEngine(CheckpointEngine):
    """The update protocol over buckets; subclasses supply the transport hooks below.

    ``delta=True`` sends each update as the changes since the version the receivers hold,
    diffed on every trainer rank's own piece of each tensor (``weightbus.engines.delta``);
    receivers then write in place (``set_destinations``)."""

    #: whether ``delta=True`` works over this engine's transport (one control group)
    supports_delta: ClassVar[bool] = True

    def __init__(self, *args: Any, delta: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(delta, bool):
            raise PlanError(f"delta must be True or False, got {delta!r}")
        if delta and not self.supports_delta:
            raise PlanError(f"delta=True is not supported by backend {type(self).__name__}: use gloo, nccl, "
                            f"nixl or mooncake (colocated copies are already at the bulk-copy floor)")
        self.delta = delta
        self._snapshots = delta_mode.Snapshots()  # trainer: what it sent last (delta mode)
        self._chain = delta_mode.Chain()  # receiver: what it applied since its last full update
        self._delta_pending: Any = None
        #: delta mode: whether the last update went full (every element) rather than as changes
        self.last_full: bool | None = None
        self._ctl: Any = None  # gloo control group (header, final status)
        self._store_server: Any = None  # trainer ranks: the rendezvous store they serve
        self._token = ""
        self._ctl_rank = -1
        self._broken: str | None = None  # why the group cannot be used any more
        self._peers_fingerprint: int | None = None  # sender root: what the group has seen
        self._manifests: dict[int, Manifest] = {}  # every rank: manifests seen, by fingerprint
        self._stream_manifest: Manifest | None = None  # plain-iterable streams
        self._plans: dict[tuple[int, int, int], BucketPlan] = {}
        self._stamper = buffers.Stamper()
        self.n_senders = 1
        #: called after every bucket this rank sent or received: ``(buckets done, buckets
        #: of the update)`` (a trainer rank counts only the buckets it sends)
        self.progress: Callable[[int, int], None] | None = None
        self._packer_of: buffers.Packer | None = None
        self._checked: tuple[Manifest, list[torch.Tensor]] | None = None  # see _held_tensors
        self._assembler_of: buffers.Assembler | None = None
        self._assembler_for: tuple[Any, Any] = (None, None)

    def _begin(self, version: int) -> None:
        """The header is through: an update to ``version`` starts on this rank (engines
        with per-update transport state reset it here)."""

    def _store_metadata(self, meta: dict[str, Any]) -> dict[str, Any]:
        """``prepare()``'s metadata; a trainer rank also serves a rendezvous store (any
        trainer may become rank 0, whose store the group meets at) under a fresh token per
        ``prepare()``, so members that join later never meet an earlier membership's keys."""
        if self.role != "rollout":
            if self._store_server is None:
                self._store_server = comm.serve_store(self.timeout)
            self._token = f"{self._store_server.port}-{id(self):x}-{secrets.token_hex(6)}"
            meta.update(port=self._store_server.port, token=self._token)
        return meta

    def _take_place(self, rank: int, T: int, R: int, bucket_size: int | None) -> None:
        """An engine with registered slots (``_slots``) joining a formation: this rank's
        place, and the bucket size the group agreed on (its slots must hold it)."""
        slots: list[torch.Tensor] = getattr(self, "_slots", [])
        if bucket_size is not None:
            if slots and slots[0].numel() < bucket_size:
                raise PlanError(f"{self.where()}: the group agreed on {bucket_size}-byte buckets, but "
                                f"this rank's slots hold {slots[0].numel()}: call prepare() again")
            self._bucket_size = int(bucket_size)
            self._plans.clear()
        self.rank, self.world_size, self.T, self.R = rank, T + R, T, R
        self.role = "trainer" if rank < T else "rollout"
        self.trainer_rank = rank if rank < T else -1
        self.n_senders = T

    # --- transport hooks -------------------------------------------------------------
    @abstractmethod
    def _packs(self, b: Bucket) -> bool:
        """Whether this trainer rank packs and sends bucket ``b``."""

    @abstractmethod
    def _owners(self, plan: BucketPlan, index: int) -> frozenset[int]:
        """Trainer ranks that need tensor ``index`` (to pack it)."""

    @abstractmethod
    def _acquire(self, b: Bucket) -> torch.Tensor:
        """A free slot for bucket ``b`` (waits for the transfer that last used it)."""

    @abstractmethod
    def _send(self, b: Bucket, slot: torch.Tensor) -> None:
        """Start moving packed bucket ``b``."""

    @abstractmethod
    def _flush_send(self, plan: BucketPlan) -> None:
        """Wait until every bucket this rank sent has left its slots."""

    @abstractmethod
    def _post_recv(self, b: Bucket) -> None:
        """Start receiving bucket ``b`` into its slot."""

    @abstractmethod
    def _wait_recv(self, b: Bucket) -> torch.Tensor:
        """Wait for bucket ``b``; returns its slot."""

    def _release(self, b: Bucket) -> None:
        """The consumer is done with bucket ``b``'s slot."""

    def _flush_recv(self, plan: BucketPlan) -> None:
        """After the last bucket."""

    def _sender_root(self) -> int:
        return 0

    # --- common helpers --------------------------------------------------------------
    def _check_ready(self, role: Role) -> None:
        if self._broken:
            raise WeightSyncError(f"{self.where()}: the group is unusable after an earlier failure "
                                  f"({self._broken}); call init_process_group again to rebuild it")
        if self._ctl is None:
            raise WeightSyncError(f"{self.where()}: no group; call prepare() and "
                                  f"init_process_group() first")
        if self.role != role:
            raise WeightSyncError(f"{self.where()}: this rank is a {self.role}; only a {role} "
                                  f"rank may call {'send' if role == 'trainer' else 'receive'}_weights")

    def _fail(self, phase: str, e: BaseException) -> WeightSyncError:
        """A transport failure: the group is now unusable; name where it happened."""
        self._broken = f"{phase}: {e}"
        return WeightSyncError(f"{self.where()}: {phase} failed: {e}")

    def _plan(self, manifest: Manifest) -> BucketPlan:
        key = (manifest.fingerprint, self.bucket_size, self.n_senders)
        plan = self._plans.get(key)
        if plan is None:
            self._plans = {key: BucketPlan(manifest, self.bucket_size, self.n_senders)}
            plan = self._plans[key]
        return plan

    def _ctl_wait(self, work: Any, phase: str) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            raise self._fail(phase, e) from e

    def _exchange_header(self, version: int, manifest: Manifest | None, error: str | None,
                         ) -> tuple[int, Manifest]:
        """Sender root -> all: version, fingerprint and (when new) the manifest.
        Returns (version, manifest). Raises on every rank if the root failed."""
        root = self._sender_root()
        hdr = torch.zeros(_HEADER_WORDS, dtype=torch.int64)
        payload = b""
        if self._ctl_rank == root:
            if error is not None or manifest is None:
                payload = (error or "no manifest").encode()[:_MESSAGE_BYTES]
                hdr[:5] = torch.tensor([buffers.MAGIC, version, 0, buffers.STATUS_ABORT, len(payload)])
            else:
                fp = manifest.fingerprint
                if self._peers_fingerprint != fp:
                    payload = manifest.to_bytes()
                hdr[:5] = torch.tensor([buffers.MAGIC, version, fp, buffers.STATUS_OK, len(payload)])
        self._ctl_wait(comm.broadcast(self._ctl, hdr, root), "header")
        magic, version, fp, status, n = hdr[:5].tolist()
        if magic != buffers.MAGIC:
            raise self._fail("header", RuntimeError(f"bad magic {magic:#x} from the sender root"))
        if n:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
                torch.empty(n, dtype=torch.uint8)
            self._ctl_wait(comm.broadcast(self._ctl, data, root), "header manifest")
            payload = bytes(data.numpy())
        if status != buffers.STATUS_OK:
            raise WeightSyncError(f"update to version {version} aborted before any data moved: "
                                  f"{payload.decode(errors='replace')}")
        if payload:
            self._manifests[fp] = manifest if self._ctl_rank == root and manifest else \
                Manifest.from_bytes(payload)
            while len(self._manifests) > 4:  # models rarely change; keep the latest few
                self._manifests.pop(next(iter(self._manifests)))
        if self._ctl_rank == root:
            self._peers_fingerprint = fp
        agreed = self._manifests.get(fp)
        if agreed is None:
            raise self._fail("header", RuntimeError(
                f"the sender root announced manifest {fp:#x} without sending it"))
        return version, agreed

    def _finish(self, version: int, error: str | None) -> None:
        """All ranks: agree on the outcome; raise the first failing rank's reason."""
        flags = self._outcome(error)
        self._ctl_wait(comm.allreduce_max(self._ctl, flags), "finish")
        self._finish_agreed(version, error, flags)

    def _reduce_max(self, t: torch.Tensor, phase: str) -> None:
        """Every rank of the update ends with the element-wise max of everyone's ``t``."""
        self._ctl_wait(comm.allreduce_max(self._ctl, t), phase)

    def _finish_settled(self, version: int, error: str | None) -> None:
        """``_finish``, then (delta mode) record what this rank holds from now on. When the
        agreement itself breaks after this rank had failed, its own reason comes first."""
        try:
            self._finish(version, error)
        except WeightSyncError as e:
            if self.delta:
                delta_mode.settle(self, False)
            if error is not None and self._broken:
                raise WeightSyncError(f"{error}; then agreeing the outcome failed: {e}") from e
            raise
        except BaseException:
            if self.delta:
                delta_mode.settle(self, False)
            raise
        if self.delta:
            delta_mode.settle(self, True)

    def _receive_delta(self, start: float, version: int, manifest: Manifest, error: str | None,
                       on_complete: Completion | None, batched: bool) -> Iterator[Any]:
        """Delta mode, receiver: patches land in the destinations; the consumer then sees
        every destination tensor once (in place: nothing to copy)."""
        error, wire, n = delta_mode.receive(self, version, manifest, error)
        closed = False
        if error is None:
            items = [(m.name, self._dest[m.name]) for m in manifest.metas]  # type: ignore[index]
            try:
                if batched:
                    yield items
                else:
                    yield from items
            except GeneratorExit:
                closed = True
                error = f"{self.where()}: the consumer stopped reading; the update is incomplete"
        self._end_receive(start, version, manifest, error, closed, on_complete, wire, n)

    def _end_receive(self, start: float, version: int, manifest: Manifest, error: str | None,
                     closed: bool, on_complete: Completion | None, wire: int, buckets: int) -> None:
        """After the last bucket: the consumer's own check, then the outcome agreed on every
        rank; a consumer that stopped reading reports its own exception (ours is recorded)."""
        if on_complete is not None and error is None and not closed:
            try:
                on_complete()
            except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                error = f"{self.where()}: version {version} failed its check after loading: {e}"
        try:
            self._finish_settled(version, error)
        except WeightSyncError:
            if closed:
                return
            raise
        self.version = version
        self.last_stats = UpdateStats(version, len(manifest), manifest.nbytes, wire,
                                      time.perf_counter() - start, buckets)
        self._log_update(self.last_stats)

    def _outcome(self, error: str | None) -> torch.Tensor:
        """This rank's say in the outcome (max-reduced: failed?, first failing rank)."""
        return torch.tensor([1 if error else 0, -self._ctl_rank if error else -(1 << 30)], dtype=torch.int64)

    def _finish_agreed(self, version: int, error: str | None, flags: torch.Tensor) -> None:
        """After the outcome's reduction: on failure, the first failing rank tells every
        rank why, and every rank raises that."""
        if flags[0].item() == 0:
            return
        src = int(-flags[1].item())
        msg = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if src == self._ctl_rank:
            raw = error.encode()[:_MESSAGE_BYTES]  # type: ignore[union-attr]
            msg[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._ctl_wait(comm.broadcast(self._ctl, msg, src), "finish")
        text = bytes(msg.numpy()).rstrip(b"\0").decode(errors="replace")
        err = WeightSyncError(f"update to version {version} failed: {text}")
        err.rank = src  # type: ignore[attr-defined]  # the control-group rank that failed first
        raise err

    # --- sender ------------------------------------------------------------------------
    async def send_weights(self, weights: Weights, *, version: int | None = None) -> UpdateStats:
        self._check_ready("trainer")
        version = self._next_version(version)
        with self._exclusive("send_weights"):
            return await self._send_update(weights, version)

    async def _send_update(self, weights: Weights, version: int) -> UpdateStats:
        start = time.perf_counter()
        error: str | None = None
        stream: _Stream | None = None
        try:
            stream = resolve_stream(weights, self._stream_manifest)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"{self.where()}: reading the weight stream: {e}"
        version, manifest = self._exchange_header(
            version, stream.manifest if stream else None, error)
        _log.debug("%s: version %d: header agreed after %.3f s", self.where(), version,
                   time.perf_counter() - start)
        if stream is not None and error is None and stream.manifest.fingerprint != manifest.fingerprint:
            error = (f"{self.where()}: its weight stream differs from the sender root's "
                     f"{manifest.first_difference(stream.manifest)}")
        if stream is not None and stream.strict_dtype:
            self._stream_manifest = stream.manifest
        self._begin(version)
        error, wire, buckets = self._transfer(manifest, stream if error is None else None, version, error)
        _log.debug("%s: version %d: %d buckets out after %.3f s", self.where(), version, buckets,
                   time.perf_counter() - start)
        await asyncio.sleep(0)
        if error and stream is not None and stream.strict_dtype:
            self._stream_manifest = None  # relearn a plain stream's manifest next time
        self._finish_settled(version, error)
        self.version = version
        self.last_stats = UpdateStats(version, len(manifest), manifest.nbytes, wire,
                                      time.perf_counter() - start, buckets)
        self._log_update(self.last_stats)
        return self.last_stats

    def _log_update(self, stats: UpdateStats) -> None:
        _log.info("%s: version %d: %d tensors, %.1f MB in %.3f s (%.2f GB/s)", self.where(), stats.version,
                  stats.tensors, stats.bytes / 1e6, stats.seconds, stats.gbps)

    def _transfer(self, manifest: Manifest, stream: _Stream | None, version: int,
                  error: str | None) -> tuple[str | None, int, int]:
        """Move the bytes of one update (through buckets, unless a subclass has a better
        way); returns (error, bytes moved, buckets). ``stream`` is None after an error."""
        if self.delta:
            return delta_mode.send(self, manifest, stream, version, error)
        plan = self._plan(manifest)
        error, wire = self._send_buckets(plan, stream, version, error)
        return error, wire, len(plan)

    def _send_buckets(self, plan: BucketPlan, stream: _Stream | None, version: int,
                      error: str | None) -> tuple[str | None, int]:
        manifest = plan.manifest
        metas = manifest.metas
        packer = self._packer(plan)
        held: list[torch.Tensor] | None = None
        if stream is not None and error is None:
            try:
                held = self._held_tensors(stream)
            except Exception as e:  # noqa: BLE001 - reported to every rank at the end
                error = f"{self.where()}: {e}"
        it = stream.open(plan, lambda i: self._owners(plan, i), self.rank_in_senders) \
            if stream is not None and held is None else None
        strict = stream.strict_dtype if stream is not None else False
        current: tuple[int, torch.Tensor | None] = (-1, None)
        wire = sent = 0
        mine_total = sum(1 for b in plan.buckets if self._packs(b)) if self.progress is not None else 0
        down: str | None = None  # the data path failed: the stream is still walked, nothing sent
        for b in plan.buckets:
            mine = self._packs(b) and down is None
            slot = None
            if mine:
                try:
                    slot = self._acquire(b)
                except TransferFailed as e:
                    down, mine = str(e), False
            tensors: list[torch.Tensor | None] = []
            if held is None:
                for c in b.chunks:
                    # every rank walks the whole stream (sharded sources gather collectively)
                    if it is not None and current[0] != c.index:
                        packer.done_with(current[0])
                        try:
                            current = (c.index, fetch(it, metas[c.index], c.index, strict))
                        except StreamBroken as e:
                            it, current = None, (c.index, None)
                            error = error or f"{self.where()}: the weight stream raised at " \
                                             f"{metas[c.index].describe()}: {e.__cause__!r}"
                        except Exception as e:  # noqa: BLE001
                            current = (c.index, None)
                            error = error or f"{self.where()}: tensor {metas[c.index].name!r}: {e}"
                    if mine and error is None and current[1] is None and metas[c.index].nbytes:
                        error = f"{self.where()}: the weight source gave no data for " \
                                f"{metas[c.index].describe()} on the rank that packs it"
                    tensors.append(current[1])
            if mine:
                if error is None:
                    try:
                        if held is not None:  # every tensor at hand: no per-tensor step
                            packer.pack_held(slot, b, held)  # type: ignore[arg-type]
                        else:
                            packer.pack_bucket(slot, b, tensors)  # type: ignore[arg-type]
                    except Exception as e:  # noqa: BLE001
                        error = f"{self.where()}: bucket {b.index}: {e}"
                self._stamper.stamp(slot, b, version,  # type: ignore[arg-type]
                                    buffers.STATUS_ABORT if error else buffers.STATUS_OK, error or "")
                try:
                    self._send(b, slot)  # type: ignore[arg-type]
                except TransferFailed as e:
                    down = str(e)
                wire += b.wire_bytes
                sent += 1
                if self.progress is not None:
                    self._report_progress(sent, mine_total)
        packer.done_with(current[0])
        if it is not None and error is None:
            extra = next(it, None)
            if extra is not None:
                error = f"{self.where()}: the weight stream has more tensors than its manifest, " \
                        f"first extra {extra[0]!r}"
        try:
            self._flush_send(plan)
        except TransferFailed as e:
            down = down or str(e)
        return error or down, wire

    def _held_tensors(self, stream: _Stream) -> list[torch.Tensor] | None:
        """The stream's tensors where its source holds them all (checked in bulk; not again
        when the source hands the same list for the same manifest as last time)."""
        last = self._checked
        held = stream.checked_tensors(last[1] if last and last[0] is stream.manifest else None)
        self._checked = (stream.manifest, held) if held is not None else None
        return held

    def _packer(self, plan: BucketPlan) -> buffers.Packer:
        """The plan's packer (its bucket views are made once and reused by every update)."""
        if self._packer_of is None or self._packer_of.plan is not plan:
            self._packer_of = buffers.Packer(plan)
        return self._packer_of

    def _assembler(self, plan: BucketPlan) -> buffers.Assembler:
        """The plan's assembler, for the current destinations (views made once)."""
        if self._assembler_of is None or self._assembler_for[0] is not plan \
                or self._assembler_for[1] is not self._dest:
            self._assembler_of = buffers.Assembler(plan, self.device, self._dest)
            self._assembler_for = (plan, self._dest)
        self._assembler_of.reset()
        return self._assembler_of

    def _report_progress(self, done: int, total: int) -> None:
        try:
            self.progress(done, total)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - a broken callback must not break the update
            _log.warning("%s: the progress callback raised (ignored): %r", self.where(), e)

    def _forget_views(self) -> None:
        """The bucket slots changed (freed, reallocated or mapped anew): views of the old
        ones must not outlive them (they would keep their memory mapped)."""
        self._packer_of = self._assembler_of = None
        self._assembler_for = (None, None)

    @property
    def rank_in_senders(self) -> int:
        return getattr(self, "trainer_rank", 0)

    # --- receiver ----------------------------------------------------------------------
    def receive_weights(self, *, expected: Manifest | None = None) -> WeightStream:
        return WeightStream(self._checked_receive(expected))

    def _checked_receive(self, expected: Manifest | None) -> Iterator[Batch]:
        self._check_ready("rollout")  # when the stream is first read, as a generator would
        yield from self._receive_iter(expected, batched=True)

    def receive_weights_sync(self, *, expected: Manifest | None = None,
                             validate: Validator | None = None,
                             on_release: Callable[[torch.Tensor], None] | None = None,
                             on_complete: Completion | None = None,
                             ) -> Iterator[tuple[str, torch.Tensor]]:
        """``receive_weights`` as a plain iterator, for consumers that take one (vLLM's
        ``load_weights``). Close it (or exhaust it) so the update completes everywhere.

        ``validate(manifest)`` runs once the manifest is known and before any tensor is
        yielded; if it raises, the update fails on every rank with its message and this
        consumer sees no tensor (its model keeps the previous weights).
        ``on_release(slot)`` runs just before a bucket's slot is reused: a consumer that
        still holds views of it copies them out then (only those it still holds).
        ``on_complete()`` runs after the last tensor was consumed and before the ranks
        agree on the outcome: if it raises (a post-load check failed), the update fails
        on every rank with its message."""
        self._check_ready("rollout")
        return self._receive_iter(expected, validate, on_release, on_complete)

    def _open_receive(self, expected: Manifest | None, validate: Validator | None = None
                      ) -> tuple[float, int, Manifest, str | None]:
        """The header of an incoming update: (start time, version, manifest, error)."""
        start = time.perf_counter()
        version, manifest = self._exchange_header(0, None, None)
        self._begin(version)
        error = None
        if expected is not None and not expected.same_tensors(manifest):
            error = (f"{self.where()}: the incoming weights (version {version}) differ from the "
                     f"expected manifest {expected.first_difference(manifest)}")
        if error is None and validate is not None:
            try:
                validate(manifest)
            except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                error = f"{self.where()}: rejected version {version} before loading: {e}"
        return start, version, manifest, error

    def _receive_iter(self, expected: Manifest | None, validate: Validator | None = None,
                      on_release: Callable[[torch.Tensor], None] | None = None,
                      on_complete: Completion | None = None, batched: bool = False) -> Iterator[Any]:
        with self._exclusive("receive_weights"):
            yield from self._receive_update(expected, validate, on_release, on_complete, batched)

    def _receive_update(self, expected: Manifest | None, validate: Validator | None,
                        on_release: Callable[[torch.Tensor], None] | None,
                        on_complete: Completion | None, batched: bool = False) -> Iterator[Any]:
        """Yields ``(name, tensor)``, or with ``batched`` one list of them per bucket."""
        start, version, manifest, error = self._open_receive(expected, validate)
        if self.delta:
            yield from self._receive_delta(start, version, manifest, error, on_complete, batched)
            return
        plan = self._plan(manifest)
        closed = False
        assembler = self._assembler(plan)
        buckets = plan.buckets
        try:  # a data-path failure that left the control group intact: agreed below
            for b in buckets[: self.num_buffers]:
                self._post_recv(b)
            for b in buckets:
                slot = self._wait_recv(b)
                status, msg = buffers.check_trailer(slot, b, version, f"{self.where()}")
                if status != buffers.STATUS_OK and error is None:
                    error = msg or f"{self.where()}: bucket {b.index} arrived with status {status}"
                if error is None and not closed and batched:
                    self.version = None  # from the first byte written on, the old version is gone
                    try:
                        batch = assembler.unpack_batch(slot, b)
                    except Exception as e:  # noqa: BLE001 - becomes this update's failure, everywhere
                        error = f"{self.where()}: unpacking bucket {b.index}: {e}"
                    else:
                        try:
                            yield batch
                        except GeneratorExit:
                            closed = True
                            first = f" (its first tensor {batch[0][0]!r})" if batch else ""
                            error = (f"{self.where()}: the consumer stopped reading in bucket {b.index}"
                                     f"{first}; the update is incomplete")
                elif error is None and not closed:
                    self.version = None  # from the first byte written on, the old version is gone
                    try:
                        for item in assembler.unpack(slot, b):
                            try:
                                yield item
                            except GeneratorExit:
                                closed = True
                                error = (f"{self.where()}: the consumer stopped reading at tensor "
                                         f"{item[0]!r} (bucket {b.index}); the update is incomplete")
                                break
                    except Exception as e:  # noqa: BLE001 - becomes this update's failure, everywhere
                        error = f"{self.where()}: unpacking bucket {b.index}: {e}"
                if on_release is not None and error is None and not closed:
                    try:
                        on_release(slot)
                    except Exception as e:  # noqa: BLE001
                        error = f"{self.where()}: releasing bucket {b.index}: {e}"
                self._release(b)
                if self.progress is not None:
                    self._report_progress(b.index + 1, len(buckets))
                nxt = b.index + self.num_buffers
                if nxt < len(buckets):
                    self._post_recv(buckets[nxt])
            self._flush_recv(plan)
        except TransferFailed as e:
            error = error or str(e)
        self._end_receive(start, version, manifest, error, closed, on_complete, plan.wire_bytes, len(plan))
