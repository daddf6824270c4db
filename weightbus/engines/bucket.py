"""Layer 3: the update protocol every bucket engine shares, and its send and receive loops.

An update on the wire, for every engine built on :class:`BucketEngine`::

    header   control group, from the sender root: magic, version, fingerprint, status,
             and the manifest itself only when the group has not seen this fingerprint
    buckets  per the BucketPlan; each bucket's trailer carries its status, so a sender
             that failed still sends its buckets, as abort notices with its error text
    finish   control group: all-reduce of every rank's status; if any rank failed, its
             message is broadcast and every rank raises the same WeightSyncError

Every rank therefore issues the same sequence of operations whatever fails, so no rank
is left blocked; a peer that dies or hangs trips the group's deadline instead.

Per update, the loops do a bounded number of calls per bucket, not per tensor: what a
bucket takes (views, copy lists, which tensors) is worked out once per plan and slot
(:class:`weightbus.packing.buffers.Packer`, :class:`weightbus.packing.buffers.Assembler`) and reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from weightbus import comm, config
from weightbus.engines import delta as delta_mode
from weightbus.engines import sharded
from weightbus.engines.api import (
    Batch,
    CheckpointEngine,
    Completion,
    Role,
    UpdateStats,
    Validator,
    Weights,
    WeightStream,
    paused_steps,
)
from weightbus.engines.delta import shards as delta_shards
from weightbus.engines.streams import Stream, StreamBroken, fetch, resolve_stream
from weightbus.errors import ConfigError, PlanError, TransferFailed, WeightSyncError
from weightbus.packing import buffers
from weightbus.packing.shards import ShardLayout, ShardPlan
from weightbus.plan import Bucket, BucketPlan, Manifest

_log = logging.getLogger("weightbus")
_HEADER_WORDS = 8
_MESSAGE_BYTES = 4096


class BucketEngine(CheckpointEngine):
    """The update protocol over buckets; subclasses supply the transport hooks below.

    ``delta=True`` sends each update as the changes since the version the receivers hold,
    diffed on every trainer rank's own piece of each tensor (``weightbus.engines.delta``);
    receivers then write in place (``set_destinations``). ``verify_every``: in delta mode,
    a receiver checks every one of its destination tensors against the running digest of
    what it was sent every this many delta updates (1, the default: every update; one read
    of the destinations), so a copy that drifted where no patch touched it fails the update,
    naming the tensors, and is resent whole; 0 never checks (default: ``WEIGHTBUS_DELTA_VERIFY``,
    else 1)."""

    #: whether ``delta=True`` works over this engine's transport (one control group)
    supports_delta: ClassVar[bool] = True

    def __init__(self, *args: Any, delta: bool = False, verify_every: int | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if not isinstance(delta, bool):
            raise PlanError(f"delta must be True or False, got {delta!r}")
        if verify_every is None:
            verify_every = config.env_integer("WEIGHTBUS_DELTA_VERIFY", minimum=0)
        self.verify_every = 1 if verify_every is None else config.integer(
            verify_every, "verify_every", minimum=0, hint=" (delta updates between checks; 0: never check)")
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
        self._peers_fingerprint: int | None = None  # sender root: what the group has seen
        self._rollback = False  # this update may carry an older version (send_weights(rollback=True))
        self._header_said = 0  # the max of every rank's last header word (see _header_flag)
        self._manifests: dict[int, Manifest] = {}  # every rank: manifests seen, by fingerprint
        self._stream_manifest: Manifest | None = None  # plain-iterable streams
        self._plans: dict[tuple[int, int, int], BucketPlan] = {}
        #: sharded updates (engines/sharded.py): whether the group shards (agreed when it
        #: forms), every rollout rank's layout this update and the (fingerprint, layout)
        #: each stated last, this rank's destinations, plans, fallbacks counted
        self._sharding = False
        self._refused = False  # (sharded) a rollout rank refused this update before its data
        self._layouts: list[ShardLayout | None] | None = None
        self._layout_seen: list[tuple[int | None, ShardLayout | None]] = []
        self._shard_dests: sharded.Destinations | None = None
        self._shard_plans: dict[tuple[Any, ...], ShardPlan] = {}
        #: sharded receive: per (bucket, slot), its slot views (and a receiver's destination
        #: views), made once per plan, slots and destinations (``sharded._tabled``)
        self._shard_copies: dict[tuple[Any, ...], Any] = {}
        self._shard_seen: list[int] | None = None  # where the destinations were when tabled
        self._sharded_got: tuple[int, int] | None = None  # (payload bytes, fallbacks) received
        self._stamper = buffers.Stamper()
        self.n_senders = 1
        #: called after every bucket this rank sent or received: ``(buckets done, buckets
        #: of the update)`` (a trainer rank counts only the buckets it sends)
        self.progress: Callable[[int, int], None] | None = None
        self._packer_of: buffers.Packer | None = None
        self._checked: tuple[Manifest, list[torch.Tensor]] | None = None  # see _held_tensors
        self._assembler_of: buffers.Assembler | None = None
        self._assembler_for: tuple[Any, Any] = (None, None)
        self._reading: WeightStream | None = None  # the stream receive_weights() last returned

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

    def _check_trailer(self, slot: torch.Tensor, b: Bucket, version: int) -> tuple[int, str]:
        """A received bucket's trailer: (status, message) (a transport may read it elsewhere)."""
        return buffers.check_trailer(slot, b, version, self.where())

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
                hdr[:6] = torch.tensor([buffers.MAGIC, version, fp, buffers.STATUS_OK, len(payload),
                                        int(self._rollback)])
        said = self._header_flag()
        if said is None:
            self._ctl_wait(comm.broadcast(self._ctl, hdr, root), "header")
        else:  # the root's words, and the max of every rank's last word, in one all-gather
            # (gloo's all-gather of a few words takes ~60% of its all-reduce's time)
            hdr[-1] = said
            every = [torch.empty_like(hdr) for _ in range(self._ctl.size())]
            self._ctl_wait(self._ctl.allgather([every], [hdr]), "header")
            hdr = every[root]
            hdr[-1] = max(int(h[-1]) for h in every)
        self._header_said = int(hdr[-1])
        magic, version, fp, status, n, rollback = hdr[:6].tolist()
        self._rollback = bool(rollback)  # (a receiver: whether the sender meant an older version)
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

    def _broadcast_ctl(self, t: torch.Tensor, root: int, phase: str) -> None:
        """``t`` from control-group rank ``root`` to every rank."""
        self._ctl_wait(comm.broadcast(self._ctl, t, root), phase)

    def _header_flag(self) -> int | None:
        """Every rank, before the header: a word it adds to the header (which then travels as
        one all-gather; the max of every rank's word is ``_header_said``), or None (a plain
        broadcast). What the sender must hear from the receivers before a byte
        moves travels here at no extra round trip."""
        return None

    def _ahead_of_header(self, stream: Stream) -> None:
        """Sender, before the header: work on ``stream`` that needs no word from the receivers,
        done while the header waits for them (it must not raise: what goes wrong is met and
        reported again after the header)."""

    def _before_bytes(self, version: int, error: str | None) -> str | None:
        """Every rank, after the header, before any byte moves: a last agreement (engines
        that write into the receivers' own memory check that it is still where it was
        said to be). Returns the update's error."""
        return error

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
                error = f"{self.where()}: {self._stopped()}; the update is incomplete"
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
        got, fallbacks = self._sharded_got or (manifest.nbytes, None)
        self.last_stats = UpdateStats(version, len(manifest), got, wire, time.perf_counter() - start,
                                      buckets, self._went_delta(), fallbacks)
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
    async def send_weights(self, weights: Weights, *, version: int | None = None,
                           rollback: bool = False) -> UpdateStats:
        self._check_ready("trainer")
        with self._exclusive("send_weights"):
            try:
                version = self._next_version(version, rollback)
            except ConfigError as e:  # the receivers hear why at once, not at their deadline
                with contextlib.suppress(Exception):  # (the header raises here too: ours is the error)
                    self._exchange_header(0, None, f"{self.where()}: {e}")
                raise
            self._rollback = rollback
            return await self._send_update(weights, version)

    async def _send_update(self, weights: Weights, version: int) -> UpdateStats:
        start = time.perf_counter()
        error: str | None = None
        stream: Stream | None = None
        try:
            stream = resolve_stream(weights, self._stream_manifest)
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = f"{self.where()}: reading the weight stream: {e}"
        if stream is not None:
            self._ahead_of_header(stream)
        version, manifest = self._exchange_header(
            version, stream.manifest if stream else None, error)
        _log.debug("%s: version %d: header agreed after %.3f s", self.where(), version,
                   time.perf_counter() - start)
        if stream is not None and error is None and stream.manifest.fingerprint != manifest.fingerprint:
            error = (f"{self.where()}: its weight stream differs from the sender root's "
                     f"{manifest.first_difference(stream.manifest)}")
        if stream is not None and stream.strict_dtype:
            self._stream_manifest = stream.manifest
        if self._sharding:
            error = sharded.agree_layouts(self, manifest, version, error)
        error = self._before_bytes(version, error)
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
                                      time.perf_counter() - start, buckets, self._went_delta())
        self._log_update(self.last_stats)
        return self.last_stats

    def _went_delta(self) -> bool | None:
        """What ``UpdateStats.delta`` says of the update just agreed."""
        return None if not self.delta or self.last_full is None else not self.last_full

    def _log_update(self, stats: UpdateStats) -> None:
        how = {None: "", True: f", as changes: {stats.wire_bytes / 1e6:.1f} MB on the wire",
               False: ", whole (delta mode)"}[stats.delta]
        _log.info("%s: version %d: %d tensors, %.1f MB in %.3f s (%.2f GB/s)%s", self.where(), stats.version,
                  stats.tensors, stats.bytes / 1e6, stats.seconds, stats.gbps, how)

    def _transfer(self, manifest: Manifest, stream: Stream | None, version: int,
                  error: str | None) -> tuple[str | None, int, int]:
        """Move the bytes of one update (through buckets, unless a subclass has a better
        way); returns (error, bytes moved, buckets). ``stream`` is None after an error."""
        if self.delta:
            if self._sharding:
                return delta_shards.send(self, manifest, stream, version, error)
            return delta_mode.send(self, manifest, stream, version, error)
        if self._sharding:
            return sharded.send(self, manifest, stream, version, error)
        plan = self._plan(manifest)
        error, wire = self._send_buckets(plan, stream, version, error)
        return error, wire, len(plan)

    def _send_buckets(self, plan: BucketPlan, stream: Stream | None, version: int,
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
                down = self._ship(b, slot, version, error) or down  # type: ignore[arg-type]
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

    def _ship(self, b: Any, slot: torch.Tensor, version: int, error: str | None) -> str | None:
        """Stamp packed bucket ``b`` (with the update's error, if any: its receivers read
        why) and start sending it; returns the transfer's failure, if it failed."""
        status = buffers.STATUS_ABORT if error else buffers.STATUS_OK
        self._stamper.stamp(slot, b, version, status, error or "")
        try:
            self._send(b, slot)
        except TransferFailed as e:
            return str(e)
        return None

    def _held_tensors(self, stream: Stream) -> list[torch.Tensor] | None:
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
        self._shard_copies = {}  # (sharded receive's tabled slot views)

    @property
    def rank_in_senders(self) -> int:
        return getattr(self, "trainer_rank", 0)

    # --- receiver ----------------------------------------------------------------------
    def receive_weights(self, *, expected: Manifest | None = None) -> WeightStream:
        self._reading = WeightStream(self._checked_receive(expected))
        return self._reading

    def _stopped(self) -> str:
        """What the consumer did, for the update's error: stopped, or failed (and why)."""
        why = self._reading.failure if self._reading is not None else None
        return f"the consumer stopped reading (it raised {why})" if why else "the consumer stopped reading"

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
        self._reading = None
        return self._receive_iter(expected, validate, on_release, on_complete)

    def _open_receive(self, expected: Manifest | None, validate: Validator | None = None
                      ) -> tuple[float, int, Manifest, str | None]:
        """The header of an incoming update: (start time, version, manifest, error)."""
        start = time.perf_counter()
        held = self.version
        version, manifest = self._exchange_header(0, None, None)
        self._begin(version)
        error = None
        if held is not None and version < held and not self._rollback:
            error = (f"{self.where()}: serves version {held}; the update carries version {version}, an older "
                     f"one: send it with rollback=True if it is meant; nothing was written")
        if error is None and expected is not None and not expected.same_tensors(manifest):
            error = (f"{self.where()}: the incoming weights (version {version}) differ from the "
                     f"expected manifest {expected.first_difference(manifest)}")
        if error is None and validate is not None:
            try:
                validate(manifest)
            except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                error = f"{self.where()}: rejected version {version} before loading: {e}"
        if self._sharding:
            error = sharded.agree_layouts(self, manifest, version, error)
        error = self._before_bytes(version, error)
        return start, version, manifest, error

    def _receive_iter(self, expected: Manifest | None, validate: Validator | None = None,
                      on_release: Callable[[torch.Tensor], None] | None = None,
                      on_complete: Completion | None = None, batched: bool = False) -> Iterator[Any]:
        with self._exclusive("receive_weights"):
            steps = self._receive_update(expected, validate, on_release, on_complete, batched)
            yield from paused_steps(steps)

    def _receive_update(self, expected: Manifest | None, validate: Validator | None,
                        on_release: Callable[[torch.Tensor], None] | None,
                        on_complete: Completion | None, batched: bool = False) -> Iterator[Any]:
        """Yields ``(name, tensor)``, or with ``batched`` one list of them per bucket."""
        start, version, manifest, error = self._open_receive(expected, validate)
        if self.delta:
            if self._sharding:
                yield from delta_shards.receive(self, start, version, manifest, error, on_complete, batched)
            else:
                yield from self._receive_delta(start, version, manifest, error, on_complete, batched)
            return
        if self._sharding:
            yield from sharded.receive(self, start, version, manifest, error, on_complete, batched)
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
                status, msg = self._check_trailer(slot, b, version)
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
                            error = (f"{self.where()}: {self._stopped()} in bucket {b.index}"
                                     f"{first}; the update is incomplete")
                elif error is None and not closed:
                    self.version = None  # from the first byte written on, the old version is gone
                    try:
                        for item in assembler.unpack(slot, b):
                            try:
                                yield item
                            except GeneratorExit:
                                closed = True
                                error = (f"{self.where()}: {self._stopped()} at tensor "
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
