"""Backend ``colocated`` (alias ``naive``): trainer and rollout on the same device.

- One process (``init_process_group()`` never called, or called with no arguments): a
  pass-through; the same engine's ``send_weights`` and ``receive_weights`` run as two
  tasks of one event loop and tensors are handed over, cast to the wire dtype, no copy.
- Across processes of one host: trainer rank i owns a ring of bucket slots that its
  rollout ranks map (POSIX shared memory on the CPU, CUDA IPC handles on a GPU), shared
  once at ``init_process_group``. Per bucket only two tiny messages move over the pair's
  gloo group: *ready* (trainer -> rollouts, a broadcast) and *ack* (an all-reduce the
  trainer waits on before it reuses the slot). Rollout rank r pairs with trainer r mod T;
  every trainer packs every bucket for its own rollout ranks. Header and final status go
  over one gloo control group of all ranks, so a failure anywhere fails the update
  everywhere (a TP-sharded replica is never left half updated without knowing).

The pair group issues its operations in one fixed order on every member: ready 0..S-1,
then (ack b-S, ready b) for each later bucket, then the remaining acks.

On a GPU neither side waits for its own copies before it speaks: each slot has a pair of
interprocess CUDA events (``torch.cuda.Event(interprocess=True)``, opened by the peer from
their handles at formation). The trainer records *packed* after a bucket's pack and sends
*ready* at once; a rollout rank looks at that event until it has run before it reads the
slot, records *released* after its copies out of the slot and acks at once; the trainer
looks at every paired rollout's *released* before it packs that slot again. So each side
queues its next copy while the other's runs, where a stream synchronize per bucket on each
side left the GPU idle between them (30b-a3b on an H200: 33.5 ms of copies in a 55-58 ms
update). The looks are host polls with the update's deadline, never a stream waiting on
the peer's event: a peer that dies with its record queued cannot block this side's GPU.
A rollout rank synchronizes once, at the end of an update, before it reports it done.

*Direct* mode (GPU): a rollout rank that calls :meth:`ColocatedEngine.set_destinations`
before ``prepare()`` exports its own tensors once over CUDA IPC; its trainer then writes
every tensor straight into them (a cast-copy, or the FSDP all-gather itself), with no
bucket and no second copy. Only the header and the final status move per update. The
rollout must be paused during the update (it always is in hybrid training) and must
call ``prepare()`` again if it reallocates those tensors (e.g. after a sleep/wake that
frees them).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import numpy as np
import torch

from weightbus import comm
from weightbus.engines.api import (
    CheckpointEngineRegistry,
    UpdateStats,
    Validator,
    Weights,
    WeightStream,
    agree_buffers,
    check_sides,
)
from weightbus.engines.bucket import BucketEngine
from weightbus.engines.streams import StreamBroken, fetch, resolve_stream
from weightbus.errors import PlanError, WeightSyncError
from weightbus.packing import buffers, native
from weightbus.plan import Bucket, BucketPlan, Manifest

_DONE = object()
_POLL_S = 50e-6  # how often a deadline-bounded wait for the GPU looks
#: direct mode: wire bytes per multi-tensor write (sources held until written, at most this)
_DIRECT_GROUP_BYTES = 256 << 20
#: direct mode, the header's word from each rank (the max of them is agreed): a rollout rank
#: that checks what landed before the outcome (``on_complete``), one whose tensors moved
_SAID_CHECKS, _SAID_MOVED = 1, 2


@CheckpointEngineRegistry.register("naive")
@CheckpointEngineRegistry.register("colocated")
class ColocatedEngine(BucketEngine):
    """Same-device engine: pass-through in one process, shared buckets across processes."""

    supports_delta = False  # same device: a bulk copy is the floor

    def __init__(self, bucket_size: int | None = None, **kwargs: Any):
        super().__init__(bucket_size, **kwargs)
        self._local = True
        self._chose_local = False  # init_process_group() was called with no arguments
        self._queue: asyncio.Queue | None = None
        self._queue_loop: asyncio.AbstractEventLoop | None = None
        self._receiver_gone = False
        self._formed = 0  # how many times a group was formed under _formed_token
        self._formed_token = ""
        self._shared: list[buffers.SharedBuffer] = []
        self._ipc: list[buffers.CupyIpcBuffer] = []
        self._slots: list[torch.Tensor] = []
        self._works: list[Any] = []  # ready/ack operations not yet waited on
        self._ready: dict[int, tuple[Any, torch.Tensor]] = {}
        self._acked = 0  # trainer: acks issued so far
        self.n_trainers = 1
        self._direct = False
        self._exported = np.zeros(0, np.int64)  # direct mode, rollout: where its exported tensors were
        self._moved = False  # direct mode, rollout: they are elsewhere now (said in the header)
        self._targets: list[dict[str, torch.Tensor]] = []  # trainer: each peer's targets
        self._pair: Any = None  # gloo group: this trainer and its rollout ranks (ready/ack)
        self.rank = 0
        self._want_direct = True
        self._direct_for: Manifest | None = None
        self._direct_list: buffers.CopyList | None = None
        self._direct_items: tuple[Manifest, dict, list] | None = None
        self._writers: tuple[Manifest, Any, list[Callable[[], bool]]] | None = None  # see _write_fused
        self._misfit_of: tuple[Manifest, str | None] | None = None
        self._own_events: list[torch.cuda.Event] = []  # per slot: packed (trainer) / released (rollout)
        self._peer_events: list[list[torch.cuda.Event]] = []  # the peers' events, per peer, per slot
        self._opened: dict[bytes, torch.cuda.Event] = {}  # (an event handle is opened once a process)
        self._trailer_stream: torch.cuda.Stream | None = None
        # direct mode on a GPU: the trainer records this event after queueing its writes and
        # its paired rollout ranks poll it (so the outcome is agreed while the copies run)
        self._written_event: torch.cuda.Event | None = None
        self._copying = False  # trainer: writes queued that its stream has not finished
        self._checks = False  # rollout: this receive has an on_complete (said in the header)
        self._staged: tuple[Any, int, Callable[..., None]] | None = None  # see _ahead_of_header

    # --- lifecycle ---------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        meta = self._store_metadata({"host": socket.gethostname(), "addr": comm.local_address(),
                                     "device": str(self.device), **self.buffer_metadata()})
        if self.role != "rollout":
            if any(not sb.linked for sb in self._shared):  # unlinked: new members cannot map them
                self._forget_views()
                for sb in self._shared:
                    sb.close()
                self._shared, self._slots = [], []
            self._allocate_slots()
            meta["slots"] = self._export_slots()
            meta["events"] = self._export_events()
        elif self._dest is not None and self._want_direct and self._can_export(self._dest):
            from torch.multiprocessing.reductions import reduce_tensor
            meta["direct"] = [(n, str(t.dtype).removeprefix("torch."), tuple(t.shape),
                               reduce_tensor(t.detach())) for n, t in self._dest.items()]
            self._exported = self._pointers()  # (what the trainer will write through)
        if self.role == "rollout":
            meta["events"] = self._export_events()
        return meta

    def _export_events(self) -> list[bytes] | None:
        """A GPU ring's per-slot events, as handles a peer process opens (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        if len(self._own_events) != self.num_buffers:
            with torch.cuda.device(self.device):
                self._own_events = [torch.cuda.Event(interprocess=True) for _ in range(self.num_buffers)]
        return [e.ipc_handle() for e in self._own_events]

    def _await(self, event: torch.cuda.Event, phase: str) -> None:
        """Until a peer's event has run, within the update's deadline."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                if event.query():
                    return
            except Exception as e:  # noqa: BLE001 - (a peer whose process ended with it queued)
                raise self._fail(phase, e) from e
            if time.monotonic() > deadline:
                raise self._fail(phase, TimeoutError(f"its GPU copies did not finish within "
                                                     f"{self.timeout:.0f}s"))
            time.sleep(_POLL_S)

    def _open_events(self, handles: list[bytes] | None) -> list[torch.cuda.Event]:
        if not handles or self.device.type != "cuda":
            return []
        out = []
        for h in handles:
            if h not in self._opened:
                self._opened[h] = torch.cuda.Event.from_ipc_handle(self.device, h)
            out.append(self._opened[h])
        return out

    def set_destinations(self, named: Mapping[str, torch.Tensor], *, direct: bool = True) -> None:
        """Rollout side, before ``prepare()``: ask the trainer to write straight into these
        tensors (direct mode; CUDA only, and not with expandable segments, whose memory
        cannot be exported). Otherwise (or with ``direct=False``) the bucket ring unpacks
        straight into them, one multi-tensor copy per bucket."""
        super().set_destinations(named)
        self._want_direct = direct

    @staticmethod
    def _can_export(named: Mapping[str, torch.Tensor]) -> bool:
        return bool(named) and not buffers.expandable_segments() and all(
            t.device.type == "cuda" and t.is_contiguous() for t in named.values())

    def _allocate_slots(self) -> None:
        if self._slots:
            return
        self._forget_views()
        if self.device.type == "cpu":
            self._shared = [buffers.SharedBuffer(self.bucket_size) for _ in range(self.num_buffers)]
            self._slots = [s.tensor for s in self._shared]
        elif buffers.expandable_segments():
            # memory from expandable segments cannot be exported as a CUDA IPC handle
            self._ipc = [buffers.CupyIpcBuffer(self.bucket_size, self.device)
                         for _ in range(self.num_buffers)]
            self._slots = [b.tensor for b in self._ipc]
        else:
            self._slots = [buffers.allocate(self.bucket_size, self.device) for _ in range(self.num_buffers)]

    def _export_slots(self) -> list[Any]:
        if self.device.type == "cpu":
            return [("shm", s.name, s.nbytes) for s in self._shared]
        if self._ipc:
            return [("cupy_ipc", b.handle, b.nbytes, b.device.index) for b in self._ipc]
        from torch.multiprocessing.reductions import reduce_tensor
        return [("cuda_ipc", reduce_tensor(t)) for t in self._slots]

    @staticmethod
    def _import_slots(spec: list[Any]) -> tuple[list[buffers.SharedBuffer], list[torch.Tensor]]:
        shared, slots = [], []
        for entry in spec:
            if entry[0] == "shm":
                sb = buffers.SharedBuffer(entry[2], name=entry[1])
                shared.append(sb)
                slots.append(sb.tensor)
            elif entry[0] == "cupy_ipc":
                slots.append(buffers.CupyIpcBuffer.open(*entry[1:]))
            else:
                rebuild, args = entry[1]
                slots.append(rebuild(*args))
        return shared, slots

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list], dict[str, list]]:
        T, R = trainer_world_size, rollout_world_size
        check_sides(T, R, metadata)
        for i in range(T):
            if "slots" not in metadata[i]:
                raise PlanError(f"metadata[{i}] must come from trainer rank {i} (role='trainer')")
        agree_buffers(T, metadata, size=False)  # (the trainers' slots set the size)
        members: list[list[int]] = [[r for r in range(R) if r % T == i] for i in range(T)]
        endpoint = lambda m: {k: m[k] for k in ("addr", "port", "token", "slots")}  # noqa: E731
        direct = all("direct" in metadata[T + r] for r in range(R))
        # on a GPU every rank's events (a ring's per slot; direct mode's "written"), or none used
        # (a side on the CPU has none)
        events = all(metadata[x].get("events") for x in range(T + R))
        keys = ("rank", "world_size", "trainer_world_size", "master", "pair_rank", "pair_size", "peer",
                "direct", "events")
        trainer: dict[str, list] = {k: [] for k in keys}
        rollout: dict[str, list] = {k: [] for k in keys}

        def add(side: dict[str, list], *values: Any) -> None:
            for k, v in zip(keys, values, strict=True):
                side[k].append(v)

        for i in range(T):
            add(trainer, i, T + R, T, endpoint(metadata[0]), 0, 1 + len(members[i]),
                endpoint(metadata[i]), [metadata[T + r]["direct"] for r in members[i]] if direct else None,
                [metadata[T + r]["events"] for r in members[i]] if events else None)
        for r in range(R):
            i = r % T
            if metadata[T + r]["host"] != metadata[i]["host"]:
                raise PlanError(f"colocated: rollout rank {r} is on host {metadata[T + r]['host']!r} "
                                f"but its trainer rank {i} is on {metadata[i]['host']!r}; "
                                f"use a collective backend across hosts")
            add(rollout, T + r, T + R, T, endpoint(metadata[0]), 1 + members[i].index(r),
                1 + len(members[i]), endpoint(metadata[i]), direct,
                [metadata[i]["events"]] if events else None)
        return trainer, rollout

    def init_process_group(self, *, rank: int | None = None, world_size: int | None = None,
                           trainer_world_size: int = 1, master: dict[str, Any] | None = None,
                           pair_rank: int | None = None, pair_size: int | None = None,
                           peer: dict[str, Any] | None = None, direct: Any = None,
                           events: list[list[bytes] | None] | None = None) -> None:
        """With no arguments: in-process pass-through. Otherwise join the control group
        of all ranks and this rank's pair group."""
        self._reset_group()
        if peer is None or master is None:
            self._local = self._chose_local = True
            return
        assert rank is not None and world_size is not None and pair_rank is not None \
            and pair_size is not None
        self._local = False
        self.rank = rank
        self.role = "trainer" if pair_rank == 0 else "rollout"
        self.trainer_rank = rank if pair_rank == 0 else -1
        self.n_trainers = trainer_world_size
        if master["token"] != self._formed_token:
            self._formed_token, self._formed = master["token"], 0
        self._formed += 1  # every member re-forms together, so the counts agree
        prefix = f"wb/{master['token']}/{self._formed}"
        if self.role == "rollout":
            self._forget_views()
            for sb in self._shared:
                sb.close()
            self._shared, self._slots = self._import_slots(peer["slots"])
            self._ipc_imported = True  # the trainer's memory, mapped: not ours
            if len(self._slots) != self.num_buffers:
                raise PlanError(f"{self.where()}: the trainer has {len(self._slots)} slots, this "
                                f"engine was built with num_buffers={self.num_buffers}")
            self._bucket_size = int(self._slots[0].numel())
        try:
            self._store = comm.connect_store(master["addr"], master["port"], self.timeout, self.where())
            self._ctl = comm.new_group("gloo", self._store, f"{prefix}/ctl", rank, world_size,
                                       self.timeout, None, self.where())
        except Exception:
            # an owner that died before every peer mapped its segments could not unlink them
            buffers.sweep_stale_segments()
            # nor will this group map ours: their names go now, whatever way this process
            # ends (the next prepare() makes new ones for a group formed again)
            for sb in self._shared:
                if sb.owner:
                    sb.unlink()
            raise
        self._ctl_rank = rank
        # every rank has joined, so every rollout has mapped the slots (it maps them before
        # joining): their names can go, and nothing is left in /dev/shm whoever dies later
        for sb in self._shared:
            if sb.owner:
                sb.unlink()
        self._direct = bool(direct)
        if self._direct:
            # trainer: map each paired rollout rank's tensors once; rollout: nothing to map
            self._targets = [{n: rebuild(*args) for n, _, _, (rebuild, args) in spec}
                             for spec in direct] if self.role == "trainer" else []
            if self.device.type == "cuda":  # no bucket ever moves: give the slots back
                self._slots, self._ipc = [], []
                self._forget_views()
            if events is not None and self.device.type == "cuda":
                # the trainer's first event: recorded by it, polled by its rollout ranks
                made = self._own_events if self.role == "trainer" else \
                    self._open_events(events[0]) if events else []
                self._written_event = made[0] if made else None
            return
        self._peer_events = [self._open_events(h) for h in events or []]  # (a GPU ring)
        if any(len(e) != len(self._slots) for e in self._peer_events):
            raise PlanError(f"{self.where()}: a peer has {[len(e) for e in self._peer_events]} slot "
                            f"events for {len(self._slots)} slots")
        if pair_size > 1:
            # (the pair meets at its trainer's store: with one trainer that is the control
            # group's, already connected; a second handshake with it is a second chance for a
            # loaded host to miss the deadline)
            same = (peer["addr"], peer["port"]) == (master["addr"], master["port"])
            store = self._store if same else comm.connect_store(peer["addr"], peer["port"], self.timeout,
                                                                 self.where())
            self._pair = comm.new_group("gloo", store, f"{prefix}/pair", pair_rank, pair_size,
                                        self.timeout, None, self.where())

    rebuild_group = init_process_group

    def _reset_group(self) -> None:
        for pg in (self._ctl, self._pair):
            if pg is not None and self._broken:
                try:
                    pg.abort()
                except Exception:  # noqa: BLE001 - it failed already
                    pass
        self._ctl, self._pair, self._broken, self._peers_fingerprint = None, None, None, None
        self._targets, self._direct = [], False
        self._peer_events = []
        self._direct_for: Manifest | None = None
        self._direct_list: buffers.CopyList | None = None
        self._direct_items: tuple[Manifest, dict, list] | None = None
        self._writers: tuple[Manifest, Any, list[Callable[[], bool]]] | None = None  # see _write_fused
        self._misfit_of: tuple[Manifest, str | None] | None = None
        self._works, self._ready, self._acked = [], {}, 0
        self._written_event, self._copying, self._staged = None, False, None

    def finalize(self, destroy_group: bool = False) -> None:
        if destroy_group:
            self._reset_group()
            self._forget_views()
            for sb in self._shared:
                sb.close()
            self._shared, self._slots, self._ipc = [], [], []
            self._store_server = None

    # --- in-process pass-through, and trainers without rollout peers --------------------
    def _check_local(self) -> None:
        """A rank built for a side (``role=``) with no group yet is waiting for peers that
        were never joined: say so at once, not after the deadline (the in-process
        pass-through is for an engine without a role, or one that chose it)."""
        if self.role is not None and not self._chose_local:
            raise WeightSyncError(f"{self.where()}: no group: call prepare() and init_process_group() "
                                  f"first (or init_process_group() with no arguments for the "
                                  f"in-process pass-through)")

    async def send_weights(self, weights: Weights, *, version: int | None = None,
                           rollback: bool = False) -> UpdateStats:
        if not self._local:
            return await super().send_weights(weights, version=version, rollback=rollback)
        self._check_local()
        version = self._next_version(version, rollback)
        with self._exclusive("send_weights"):
            return await self._send_local(weights, version)

    async def _send_local(self, weights: Weights, version: int) -> UpdateStats:
        start = time.perf_counter()
        stream = resolve_stream(weights, None)
        manifest = stream.manifest
        queue = self._local_queue()
        self._receiver_gone = False
        await self._put(queue, ("header", version, manifest))
        error = None
        try:
            it = stream.open(None, lambda i: frozenset({0}), 0)  # type: ignore[arg-type]
            for meta in manifest:
                name, t = next(it)
                if name != meta.name:
                    raise PlanError(f"the weight stream gives {name!r} where the manifest has "
                                    f"{meta.describe()}")
                buffers.check_castable(meta, t)
                await self._put(queue, (name, t if t.dtype == meta.dtype else t.to(meta.dtype)))
        except WeightSyncError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the receiver too
            error = f"{self.where()}: {e}"
        await self._put(queue, (_DONE, error))
        if error:
            raise WeightSyncError(f"update to version {version} failed: {error}")
        self.version = version
        return UpdateStats(version, len(manifest), manifest.nbytes, 0, time.perf_counter() - start, 0)

    def _local_queue(self) -> asyncio.Queue:
        # one queue per event loop: each asyncio.run() brings a new loop, and a queue is
        # bound to the loop it first waited on
        loop = asyncio.get_running_loop()
        if self._queue is None or self._queue_loop is not loop:
            self._queue, self._queue_loop = asyncio.Queue(maxsize=2), loop
        return self._queue

    async def _put(self, queue: asyncio.Queue, item: Any) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            if self._receiver_gone:
                raise WeightSyncError(f"{self.where()}: the in-process receiver stopped reading")
            try:
                await asyncio.wait_for(queue.put(item), timeout=min(1.0, self.timeout))
                return
            except asyncio.TimeoutError:
                if time.monotonic() > deadline:
                    raise WeightSyncError(f"{self.where()}: no in-process receiver took the weights "
                                          f"within {self.timeout:.0f}s") from None

    def receive_weights(self, *, expected: Manifest | None = None) -> WeightStream:
        if not self._local and self._direct:
            return WeightStream(self._receive_direct(expected, batched=True))
        if not self._local:
            return super().receive_weights(expected=expected)
        return WeightStream(self._receive_local_batches(expected))

    async def _receive_local_batches(self, expected: Manifest | None) -> AsyncIterator[list[Any]]:
        self._check_local()
        with self._exclusive("receive_weights"):
            async for item in self._receive_local(expected):
                yield [item]

    async def _receive_local(self, expected: Manifest | None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        queue = self._local_queue()
        try:
            kind, version, manifest = await asyncio.wait_for(queue.get(), self.timeout)
        except asyncio.TimeoutError:
            raise WeightSyncError(
                f"{self.where()}: no in-process sender within {self.timeout:.0f}s") from None
        try:
            if expected is not None:
                expected.check_same(manifest, f"{self.where()}: incoming version {version}")
            self.version = None  # the consumer writes as tensors arrive: torn until the end
            while True:
                name, t = await asyncio.wait_for(queue.get(), self.timeout)
                if name is _DONE:
                    if t:
                        raise WeightSyncError(f"update to version {version} failed: {t}")
                    break
                yield name, t
        except BaseException:
            self._receiver_gone = True
            while not queue.empty():
                queue.get_nowait()
            raise
        self.version = version

    def receive_weights_sync(self, *, expected: Manifest | None = None,
                             validate: Validator | None = None,
                             on_release: Callable[[torch.Tensor], None] | None = None,
                             on_complete: Callable[[], None] | None = None) -> Any:
        if self._local:
            raise WeightSyncError(f"{self.where()}: in-process pass-through needs receive_weights() "
                                  f"in the sender's event loop")
        if self._direct:  # the trainer writes in place: a rejection comes after the bytes
            return self._receive_direct(expected, validate, on_complete)
        return super().receive_weights_sync(expected=expected, validate=validate,
                                            on_release=on_release, on_complete=on_complete)

    # --- direct mode ---------------------------------------------------------------------
    @staticmethod
    def _misfit(manifest: Manifest, targets: Mapping[str, torch.Tensor]) -> str | None:
        """Why ``manifest`` cannot be written into ``targets`` (None if it can)."""
        names = {m.name for m in manifest}
        problems = [f"missing on the rollout: {m.describe()}" for m in manifest if m.name not in targets]
        problems += [f"the rollout has {n!r} {str(t.dtype).removeprefix('torch.')}{list(t.shape)}, "
                     f"the trainer sends {m.describe()}"
                     for m in manifest for n, t in [(m.name, targets.get(m.name))]
                     if t is not None and (t.dtype != m.dtype or tuple(t.shape) != m.shape)]
        problems += [f"never sent: {n!r}" for n in targets if n not in names]
        return "; ".join(problems[:5]) or None

    def _ahead_of_header(self, stream: Any) -> None:
        """Direct mode, trainer: the copy's look at the sources (their addresses, that they fit
        the rollout's tensors), taken while the header waits for the rollout ranks' word; the
        copies then start as soon as it is agreed. Anything amiss is left to the usual path,
        after the header, which reports it."""
        self._staged = None
        if not self._direct or not self._targets or getattr(stream.source, "direct_writer", None):
            return
        try:
            launch = self._stage_copies(stream, stream.manifest) \
                if self._direct_misfit(stream.manifest) is None else None
            if launch is not None:
                self._staged = (stream, stream.manifest.fingerprint, launch)
        except Exception:  # noqa: BLE001 - said after the header, by the path that meets it again
            self._staged = None

    def _stage_copies(self, stream: Any, manifest: Manifest) -> Callable[..., None] | None:
        """Direct mode, trainer, every tensor at hand: one multi-tensor cast-copy into every
        paired rollout rank's tensors, over a destination list made once per manifest, its
        look at the sources taken now (the launch, returned, when called); None where the
        source does not hold its tensors."""
        held = self._held_tensors(stream)
        return None if held is None else self._direct_copies(manifest).stage(held * len(self._targets))

    def _transfer(self, manifest: Manifest, stream: Any, version: int,
                  error: str | None) -> tuple[str | None, int, int]:
        if not self._direct:
            return super()._transfer(manifest, stream, version, error)
        why = self._direct_misfit(manifest)
        if why and error is None:
            error = f"{self.where()}: direct mode: {why}"
        staged, self._staged = self._staged, None
        launch: Callable[..., None] | None = None
        written = False
        if stream is not None and error is None:
            try:
                if staged is not None and staged[0] is stream and staged[1] == manifest.fingerprint:
                    launch = staged[2]
                else:
                    written = self._write_fused(manifest, stream)
                    launch = None if written else self._stage_copies(stream, manifest)
            except Exception as e:  # noqa: BLE001 - reported to every rank
                error = f"{self.where()}: {e}"
        if launch is not None and error is None:
            try:
                launch(lambda k: manifest[k % len(manifest)].describe())
            except Exception as e:  # noqa: BLE001
                error = f"{self.where()}: {e}"
            self._queued()
        elif written:
            self._queued()
        elif stream is not None:
            # every trainer iterates (sharded sources gather collectively); only a rank
            # with no error writes
            first = self._targets[0] if self._targets and error is None else None
            into = (lambda i: first[manifest[i].name]) if first is not None else None
            it = stream.open(None, lambda i: frozenset(range(self.n_trainers)), self.trainer_rank,
                             into=into)
            # the writes go out a group at a time (one multi-tensor cast-copy per group),
            # not a tensor per call
            dsts: list[torch.Tensor] = []
            srcs: list[torch.Tensor] = []
            where: list[int] = []
            pending = 0
            for i, meta in enumerate(manifest):
                try:
                    t = fetch(it, meta, i, stream.strict_dtype)
                    if error is None and t is not None:
                        for targets in self._targets:
                            dst = targets[meta.name]
                            if dst.data_ptr() != t.data_ptr():  # (a gather may have written it)
                                dsts.append(dst)
                                srcs.append(t)
                                where.append(i)
                                pending += meta.nbytes
                    if pending >= _DIRECT_GROUP_BYTES:
                        buffers.copy_group(dsts, srcs, lambda k, w=where: manifest[w[k]].describe())
                        dsts, srcs, where, pending = [], [], [], 0
                except StreamBroken as e:
                    error = error or f"{self.where()}: the weight stream raised at " \
                                     f"{meta.describe()}: {e.__cause__!r}"
                    break
                except Exception as e:  # noqa: BLE001
                    error = error or f"{self.where()}: tensor {meta.name!r}: {e}"
            if error is None:
                try:
                    buffers.copy_group(dsts, srcs, lambda k: manifest[where[k]].describe())
                except Exception as e:  # noqa: BLE001
                    error = f"{self.where()}: {e}"
            self._queued()
        return error, manifest.nbytes * len(self._targets), 0

    def _queued(self) -> None:
        """Direct mode, trainer, its writes queued: the paired rollout ranks see them done by
        the event recorded now (the outcome is agreed meanwhile); without one (a CPU peer),
        they are done before the outcome is agreed."""
        if self.device.type != "cuda":
            return
        if self._written_event is not None:
            self._written_event.record(torch.cuda.current_stream(self.device))
            self._copying = True
        else:
            torch.cuda.current_stream(self.device).synchronize()  # written before 'done'

    def _finish_settled(self, version: int, error: str | None) -> None:
        """Direct mode, trainer: the outcome, agreed while its writes run; then, where a rollout
        rank checks what landed (``on_complete``), a second agreement with its verdict; the
        writes are done before it returns."""
        if not (self._direct and self.role == "trainer"):
            return super()._finish_settled(version, error)
        try:
            super()._finish_settled(version, error)
            if self._header_said == _SAID_CHECKS:
                super()._finish_settled(version, None)
        finally:
            if self._copying:
                self._copying = False
                torch.cuda.current_stream(self.device).synchronize()

    def _pointers(self) -> np.ndarray:
        return native.data_ptrs(list((self._dest or {}).values()))

    def _header_flag(self) -> int | None:
        """Direct mode: the trainer writes through the handles a rollout exported at
        ``prepare()``. A rollout whose tensors moved since (``param.data = ...``, a sleep
        that frees and re-allocates them) would have the trainer write into memory that is
        no longer its tensors': each rollout rank says so in the header, so every rank knows
        before a byte moves, and the update fails everywhere, naming the rank, until the
        group is formed again (``prepare()``). A rollout rank that checks what landed
        (``on_complete``) says so too: the outcome is then agreed once more, after its check."""
        if not self._direct:
            return None
        self._moved = self.role == "rollout" and not np.array_equal(self._pointers(), self._exported)
        return _SAID_MOVED if self._moved else _SAID_CHECKS if self._checks else 0

    def _before_bytes(self, version: int, error: str | None) -> str | None:
        if not self._direct or error is not None:
            return error
        if self._moved:
            return (f"{self.where()}: its destination tensors moved since prepare() exported them; "
                    f"nothing was written: form the group again (prepare() and init_process_group on "
                    f"every rank) after re-allocating them")
        if self._header_said >= _SAID_MOVED:
            return f"{self.where()}: a rollout rank's destinations moved since they were exported; " \
                   f"nothing was written"
        return error

    def _direct_misfit(self, manifest: Manifest) -> str | None:
        """Why ``manifest`` cannot be written into the paired rollout ranks' tensors (None if
        it can): worked out once per manifest and membership (a look at every tensor, which
        an MoE model of thousands would otherwise pay at every update)."""
        known = self._misfit_of
        if known is None or known[0] != manifest:  # (the same tensors: equal fingerprints)
            why = next((w for w in (self._misfit(manifest, t) for t in self._targets) if w), None)
            known = self._misfit_of = (manifest, why)
        return known[1]

    def _write_fused(self, manifest: Manifest, stream: Any) -> bool:
        """Direct mode: a source that can write its tensors into the rollout's itself
        (``direct_writer``: a :class:`~weightbus.quant.QuantizedSource` quantizes straight into
        the rollout's fp8 weights, with no fp8 copy of the model between) does so for every
        paired rollout rank; False where it cannot, and the engine copies as usual. The
        writers hold the rollout's tensors: kept per source and manifest, dropped with the
        group (so a rollout's memory is never held past it)."""
        make = getattr(stream.source, "direct_writer", None)
        if make is None or not self._targets:
            return False
        known = self._writers
        if known is None or known[0] is not manifest or known[1] is not stream.source:
            known = self._writers = (manifest, stream.source,
                                     [make([t[m.name] for m in manifest]) for t in self._targets])
        return all([write() for write in known[2]])

    def _direct_copies(self, manifest: Manifest) -> buffers.CopyList:
        """Direct mode: every paired rollout rank's tensors, in manifest order (made once
        per manifest and membership)."""
        if self._direct_for != manifest or self._direct_list is None:
            self._direct_list = buffers.CopyList([targets[m.name] for targets in self._targets
                                                  for m in manifest])
            self._direct_for = manifest
        return self._direct_list

    def _receive_direct(self, expected: Manifest | None, validate: Validator | None = None,
                        on_complete: Callable[[], None] | None = None, batched: bool = False) -> Any:
        self._check_ready("rollout")
        with self._exclusive("receive_weights"):
            yield from self._receive_direct_update(expected, validate, on_complete, batched)

    def _receive_direct_update(self, expected: Manifest | None, validate: Validator | None,
                               on_complete: Callable[[], None] | None, batched: bool) -> Any:
        self._checks = on_complete is not None
        try:
            start, version, manifest, error = self._open_receive(expected, validate)
        finally:
            self._checks = False
        self.version = None  # the trainer writes into our tensors from the header on
        self._finish(version, error)  # the trainers' writes are queued, or every rank raises
        if self._header_said == _SAID_CHECKS:  # a check of what landed, agreed once more
            error = None
            try:
                self._await_written()
                if on_complete is not None:
                    on_complete()
            except Exception as e:  # noqa: BLE001 - this update's failure, on every rank
                error = f"{self.where()}: version {version} failed its check after loading: {e}"
            self._finish(version, error)
        else:
            self._await_written()
        self.version = version
        self.last_stats = UpdateStats(version, len(manifest), manifest.nbytes, 0,
                                      time.perf_counter() - start, 0)
        batch = self._direct_batch(manifest)
        if batched:
            yield batch
        else:
            yield from batch

    def _await_written(self) -> None:
        """Direct mode, rollout: until the paired trainer's writes into this rank's tensors
        have run (its event, recorded before the outcome was agreed), within the deadline."""
        if self._written_event is not None:
            self._await(self._written_event, "waiting for the trainer's writes into this rank's tensors")

    def _direct_batch(self, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
        """Direct mode, rollout side: every tensor, written in place, as one list (made once
        per manifest and destinations, so a sink's work on it is done once too)."""
        dest = self._dest
        assert dest is not None
        made = self._direct_items
        if made is None or made[0] is not manifest or made[1] is not dest:
            made = self._direct_items = (manifest, dest, [(m.name, dest[m.name]) for m in manifest])
        return made[2]

    # --- transport hooks (across processes) ---------------------------------------------
    def _packs(self, b: Bucket) -> bool:
        return self._pair is not None  # a trainer with no rollout rank of its own packs nothing

    def _owners(self, plan: BucketPlan, index: int) -> frozenset[int]:
        # every trainer serves its own rollout ranks every tensor (same set on every rank,
        # so sharded sources all-gather)
        return frozenset(range(self.n_trainers))

    def _op(self, work: Any, phase: str) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            raise self._fail(phase, e) from e

    def _ack(self, index: int) -> Any:
        try:
            return comm.allreduce_max(self._pair, torch.zeros(1, dtype=torch.int64))
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"ack of bucket {index}", e) from e

    def _acquire(self, b: Bucket) -> torch.Tensor:
        k = b.index % self.num_buffers
        if b.index >= self.num_buffers:
            done = b.index - self.num_buffers
            self._op(self._ack(done), f"waiting for the rollout ranks to release bucket {done}")
            self._acked = done + 1
            for events in self._peer_events:  # (their copies out of it were queued, maybe not run)
                self._await(events[k], f"waiting for the rollout ranks' copies out of bucket {done}")
        return self._slots[k]

    def _send(self, b: Bucket, slot: torch.Tensor) -> None:
        if self._peer_events:  # the rollout ranks look at it before they read the slot
            self._own_events[b.index % self.num_buffers].record(torch.cuda.current_stream(slot.device))
        elif slot.device.type == "cuda":
            # the rollout ranks read the slot as soon as they see 'ready'
            torch.cuda.current_stream(slot.device).synchronize()
        try:
            self._works.append(comm.broadcast(self._pair, torch.tensor([b.index, 0]), 0))
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"ready of bucket {b.index}", e) from e

    def _flush_send(self, plan: BucketPlan) -> None:
        if self._pair is None:
            return
        for i in range(self._acked, len(plan)):
            self._works.append(self._ack(i))
        works, self._works, self._acked = self._works, [], 0
        for w in works:
            self._op(w, "waiting for the rollout ranks to release the last buckets")

    def _post_recv(self, b: Bucket) -> None:
        msg = torch.zeros(2, dtype=torch.int64)
        try:
            self._ready[b.index] = (comm.broadcast(self._pair, msg, 0), msg)
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"ready of bucket {b.index}", e) from e

    def _wait_recv(self, b: Bucket) -> torch.Tensor:
        work, msg = self._ready.pop(b.index)
        self._op(work, f"waiting for the paired trainer to fill bucket {b.index}")
        if int(msg[0]) != b.index:
            raise self._fail(f"bucket {b.index}", RuntimeError(f"trainer announced bucket {int(msg[0])}"))
        k = b.index % self.num_buffers
        if self._peer_events:  # (the trainer's pack into it was queued, maybe not run)
            self._await(self._peer_events[0][k], f"waiting for the trainer's copies into bucket {b.index}")
        return self._slots[k]

    def _check_trailer(self, slot: torch.Tensor, b: Bucket, version: int) -> tuple[int, str]:
        if not self._peer_events:
            return super()._check_trailer(slot, b, version)
        # the trainer's copies into the slot have run (its event): read the trailer on a
        # stream of its own, not behind this rank's copies out of the previous bucket
        if self._trailer_stream is None:
            self._trailer_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._trailer_stream):
            return super()._check_trailer(slot, b, version)

    def _release(self, b: Bucket) -> None:
        k = b.index % self.num_buffers
        slot = self._slots[k]
        if self._peer_events:  # the trainer looks at it before it packs the slot again
            self._own_events[k].record(torch.cuda.current_stream(self.device))
        elif slot.device.type == "cuda":
            # the consumer's copies out of the slot must be done before the trainer reuses it
            torch.cuda.current_stream().synchronize()
        self._works.append(self._ack(b.index))

    def _flush_recv(self, plan: BucketPlan) -> None:
        works, self._works = self._works, []
        for w in works:
            self._op(w, "acknowledging the last buckets")
        if self._peer_events:  # every copy out of the slots has run before 'done'
            torch.cuda.current_stream(self.device).synchronize()
