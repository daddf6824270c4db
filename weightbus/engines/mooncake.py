"""Backend ``mooncake``: rollout replicas pull buckets point to point from the trainer ranks
with the Mooncake transfer engine, and relay them inside the replica over its own group.

Topology, T trainer ranks and R rollout ranks in replicas of ``replica_size`` = k ranks::

    trainer t (passive): packs its buckets b = t, t+T, ... into a ring of S registered
                         host slots, tells each replica leader "bucket b is in slot s"
    replica leader j:    for every bucket: waits for that word, reads the slot from its
                         owner (one Mooncake read: TCP here, RDMA where there is RDMA),
                         acks it, broadcasts it to the replica's other k-1 ranks (gloo)
    other replica ranks: receive the broadcast

Every trainer rank's link carries its own share of the model once per replica; nothing is
staged whole (Kimi's checkpoint engine pins the trainer's whole model in host memory first:
7-23 s for 8B-30B models), and the trainer never pushes: the replicas read. A trainer reuses
a slot only when every leader has acked its previous bucket. Each replica has a control
group of its own with the trainer ranks (a *link*); the small words (ready, ack) travel as
gloo point-to-point messages on it, tagged with the version, and the core's header and
final status run on each link. So a replica joins or leaves without touching any other
replica's connections, and one that dies or hangs mid-update is dropped from that update
(after half the deadline without an ack) while the others complete it; the trainer then
raises :class:`~weightbus.errors.ReplicasFailed`. Every wait has the engine's deadline.

No metadata service is needed: the transfer engines meet with Mooncake's peer-to-peer
handshake (``P2PHANDSHAKE``), each side naming itself ``host:rpc_port``; the slot addresses
travel in ``prepare()``'s metadata. The transfer engines connect on demand: a replica that
is gone is simply not read for.

Mooncake (``pip install 'weightbus[mooncake]'``, the ``non-cuda`` build on machines without
CUDA; it needs ``libibverbs1``) does the moving; we decide who reads which slot when, which
no Mooncake API covers.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from weightbus import comm, config
from weightbus.engines.api import CheckpointEngineRegistry, agree_buffers, check_sides
from weightbus.engines.links import Link, LinkedEngine, close, link_topology, replicas_of
from weightbus.errors import PlanError, WeightSyncError, as_timedelta
from weightbus.packing import buffers
from weightbus.plan import Bucket, BucketPlan

_READY, _ACK = 1, 2  # gloo point-to-point tags of the two control words


def _mooncake_api() -> Any:
    """Mooncake's TransferEngine class, or an error that says how to get it."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        hint = " (its library needs libibverbs1: apt-get install libibverbs1)" if "ibverbs" in str(e) else ""
        raise PlanError("backend 'mooncake' needs the Mooncake transfer engine: pip install "
                        "'weightbus[mooncake]' (mooncake-transfer-engine-non-cuda without CUDA, "
                        f"mooncake-transfer-engine with it){hint}: {e}") from None
    return TransferEngine


@CheckpointEngineRegistry.register("mooncake")
class MooncakeEngine(LinkedEngine):
    """Replica leaders read buckets from the trainer ranks and relay them inside their
    replica (see the module doc). Elastic: replicas are linked to the trainers one by one
    (:meth:`link_replicas`, :meth:`attach`), and an update that loses one replica still
    completes on the others (the trainer then raises :class:`ReplicasFailed`).

    Args (besides the common ones):
        replica_size: rollout ranks per replica (rollout side; every rollout rank gives the
            same). Rollout ranks ``j*k .. j*k+k-1`` form replica ``j``; the first reads.
        protocol: the transfer engine's transport, ``tcp`` (default) or ``rdma``.
        device_name: RDMA device(s) for ``rdma`` (e.g. ``mlx5_0``); empty for ``tcp``.
    """

    def __init__(self, bucket_size: int | None = None, *, replica_size: int = 1,
                 protocol: str = "tcp", device_name: str = "", **kwargs: Any):
        self._api = _mooncake_api()  # fails here, naming the extra, not at the first update
        super().__init__(bucket_size, **kwargs)
        if self.device.type != "cpu":
            raise PlanError(f"backend 'mooncake' moves host memory: device={self.device} is not "
                            f"supported (use 'nccl' or 'nixl' between GPUs)")
        self.replica_size = config.integer(replica_size, "replica_size", minimum=1, maximum=1 << 16)
        if protocol not in ("tcp", "rdma"):
            raise PlanError(f"protocol must be 'tcp' or 'rdma', got {protocol!r}")
        self.protocol, self.device_name = protocol, str(device_name)
        self._te: Any = None
        self._session = ""
        self._slots: list[torch.Tensor] = []
        self._registered: list[int] = []
        # rollout side
        self._sources: dict[int, tuple[str, list[int]]] = {}  # trainer -> (session, slot addrs)
        self._is_leader = False
        self._replica: Any = None  # the replica's own group (k > 1)
        self._version = 0
        self._words: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # (peer, bucket) -> recv
        self._held: dict[int, int] = {}  # trainer: slot -> the bucket it last held
        self._sent: list[tuple[Any, torch.Tensor]] = []  # isends in flight (tensors kept alive)

    # --- lifecycle ---------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        self._open()
        meta: dict[str, Any] = {"addr": comm.local_address(), "device": str(self.device),
                                **self.buffer_metadata(), "session": self._session,
                                "slots": [s.data_ptr() for s in self._slots],
                                "replica_size": self.replica_size, "replica": self.replica}
        return self._store_metadata(meta)

    def _open(self) -> None:
        """The transfer engine (once per engine) and the slots, registered with it; slots
        are kept while they are large enough."""
        if self._te is None:
            addr = comm.local_address()
            te = self._api()
            rc = te.initialize(addr, "P2PHANDSHAKE", self.protocol, self.device_name)
            if rc != 0:
                raise WeightSyncError(f"{self.where()}: the Mooncake transfer engine did not start "
                                      f"(initialize({addr!r}, P2PHANDSHAKE, {self.protocol!r}): {rc})")
            self._te, self._session = te, f"{addr}:{te.get_rpc_port()}"
        if self._slots and self._slots[0].numel() >= self.bucket_size:
            return
        self._unregister()
        self._slots = [buffers.allocate(self.bucket_size, self.device) for _ in range(self.num_buffers)]
        self._forget_views()
        for s in self._slots:
            if self._te.register_memory(s.data_ptr(), s.numel()) != 0:
                raise WeightSyncError(f"{self.where()}: Mooncake could not register a "
                                      f"{s.numel() >> 20} MiB slot")
            self._registered.append(s.data_ptr())

    def _unregister(self) -> None:
        for ptr in self._registered:
            try:
                self._te.unregister_memory(ptr)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._registered = []

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list], dict[str, list]]:
        T, R = trainer_world_size, rollout_world_size
        check_sides(T, R, metadata)
        if "port" not in metadata[0]:
            raise PlanError("metadata[0] must come from trainer rank 0 (it holds the rendezvous store)")
        replicas = replicas_of([m.get("replica") for m in metadata[T:]],
                               [m.get("replica_size", 1) for m in metadata[T:]])
        common = {"trainer_world_size": T, "rollout_world_size": R, "master_addr": metadata[0]["addr"],
                  "master_port": metadata[0]["port"], "token": metadata[0]["token"],
                  "bucket_size": agree_buffers(T, metadata)}
        return link_topology(T, R, metadata, replicas, common)

    def _joined(self, prefix: str, k: int, trainer_metadata: list[dict[str, Any]]) -> None:
        self._is_leader = self._replica_rank == 0
        self._sources = _sources(trainer_metadata) if self._is_leader else {}
        if self._is_leader and len(self._sources) != self.T:
            raise PlanError(f"{self.where()}: a replica leader needs the slots of all {self.T} trainer "
                            f"ranks, got {sorted(self._sources)}")
        if k > 1:
            self._replica = comm.new_group("gloo", self._store, f"{prefix}/replica", self._replica_rank,
                                           k, self.timeout, None, self.where())

    def _drop_all(self) -> None:
        super()._drop_all()
        if self._replica is not None:
            close(self._replica, bool(self._broken))
        self._replica = None
        self._words, self._sent = {}, []

    def finalize(self, destroy_group: bool = False) -> None:
        if destroy_group:
            self._drop_all()
            self._master = None
            self._unregister()
            self._slots, self._te, self._store_server = [], None, None
            self._forget_views()

    # --- control words -------------------------------------------------------------------
    def _who(self, rank: int) -> str:
        return f"trainer rank {rank}" if rank < self.T else f"replica rank {rank - self.T}"

    def _word(self, b: int) -> torch.Tensor:
        return torch.tensor([self._version, b], dtype=torch.int64)

    def _check_word(self, w: torch.Tensor, b: int, who: str) -> None:
        got = w.tolist()
        if got != [self._version, b]:
            raise RuntimeError(f"{who} sent version {got[0]} bucket {got[1]}; expected version "
                               f"{self._version} bucket {b}")

    def _begin(self, version: int) -> None:
        self._version = version
        self._words.clear()
        for link in self._links.values():
            link.words.clear()
            link.sent.clear()

    # trainer: READY to every live leader, ACK back; a failure loses that replica only
    def _await_ack(self, link: Link, b: int, phase: str) -> None:
        work, w = link.words.pop(b)
        try:
            # half the deadline: a replica that stopped reading is dropped from this update
            # before the others, whose waits have the whole deadline, give up on it
            work.wait(as_timedelta(self.timeout / 2))
            self._check_word(w, b, f"replica {link.id!r}")
        except Exception as e:  # noqa: BLE001
            self._lose(link, phase, e)

    def _acquire(self, b: Bucket) -> torch.Tensor:
        s = self._slot_of(b)
        prev = self._held.get(s)  # the bucket this slot held last
        if prev is not None and b.turn >= self.num_buffers:
            for link in self._live():
                self._await_ack(link, prev, f"send bucket {b.index}: waiting for replica {link.id!r} "
                                            f"to read bucket {prev}")
        self._held[s] = b.index
        return self._slots[s]

    def _send(self, b: Bucket, slot: torch.Tensor) -> None:
        for link in self._live():
            ack, ready = torch.empty(2, dtype=torch.int64), self._word(b.index)
            try:
                link.words[b.index] = (link.pg.recv([ack], self.T, _ACK), ack)
                link.sent.append((link.pg.send([ready], self.T, _READY), ready))
            except Exception as e:  # noqa: BLE001
                self._lose(link, f"telling replica {link.id!r} about bucket {b.index}", e)

    def _flush_send(self, plan: BucketPlan) -> None:
        mine = sum(1 for b in plan.buckets if b.owner == self.trainer_rank)
        for b in plan.buckets:  # the last reads of every slot: done before the slots are reused
            if b.owner == self.trainer_rank and b.turn + self.num_buffers >= mine:
                for link in self._live():
                    self._await_ack(link, b.index,
                                    f"waiting for replica {link.id!r} to read bucket {b.index}")
        for link in self._live():
            sent, link.sent = link.sent, []
            for work, _ in sent:
                try:
                    work.wait()
                except Exception as e:  # noqa: BLE001
                    self._lose(link, f"telling replica {link.id!r} about a bucket", e)
                    break

    # rollout leader: READY from the owner, read, ACK
    def _post_recv(self, b: Bucket) -> None:
        if self._is_leader:
            w = torch.empty(2, dtype=torch.int64)
            try:
                self._words[(b.owner, b.index)] = (self._ctl.recv([w], b.owner, _READY), w)
            except Exception as e:  # noqa: BLE001
                raise self._fail(f"waiting for {self._who(b.owner)} about bucket {b.index}", e) from e

    def _wait_recv(self, b: Bucket) -> torch.Tensor:
        slot = self._slots[b.index % self.num_buffers]
        if self._is_leader:
            owner = b.owner
            phase = f"receive bucket {b.index}: waiting for {self._who(owner)}"
            work, w = self._words.pop((owner, b.index))
            self._ctl_wait(work, phase)
            try:
                self._check_word(w, b.index, self._who(owner))
            except RuntimeError as e:
                raise self._fail(phase, e) from e
            self._read(owner, b, slot)
            ack = self._word(b.index)
            try:
                self._sent.append((self._ctl.send([ack], owner, _ACK), ack))
            except Exception as e:  # noqa: BLE001
                raise self._fail(f"telling {self._who(owner)} bucket {b.index} was read", e) from e
        if self._replica is not None:
            self._ctl_wait(comm.broadcast(self._replica, slot[:b.wire_bytes], 0),
                           f"relay bucket {b.index} inside the replica")
        return slot

    def _flush_recv(self, plan: BucketPlan) -> None:
        sent, self._sent = self._sent, []
        for work, _ in sent:
            self._ctl_wait(work, "sending a control word")

    # --- transport hooks ---------------------------------------------------------------
    def _slot_of(self, b: Bucket) -> int:
        return b.turn % self.num_buffers  # an owner's own buckets, in turn

    def _packs(self, b: Bucket) -> bool:
        return b.owner == self.trainer_rank

    def _owners(self, plan: BucketPlan, index: int) -> frozenset[int]:
        return plan.owners_of(index)

    def _read(self, owner: int, b: Bucket, slot: torch.Tensor) -> None:
        """One Mooncake read of bucket ``b`` from its owner's slot, with our deadline."""
        session, addrs = self._sources[owner]
        remote = addrs[self._slot_of(b) % len(addrs)]
        phase = f"read bucket {b.index} from {self._who(owner)} ({session})"
        try:
            batch = self._te.batch_transfer_async_read(session, [slot.data_ptr()], [remote], [b.wire_bytes])
        except Exception as e:  # noqa: BLE001
            raise self._fail(phase, e) from e
        if not batch:
            raise self._fail(phase, RuntimeError("Mooncake refused the read (is the peer gone?)"))
        deadline = time.monotonic() + self.timeout
        pause = comm.Pause()
        while True:
            try:
                state = self._te.transfer_check_status(batch)
            except Exception as e:  # noqa: BLE001
                raise self._fail(phase, e) from e
            if state == 1:
                return
            if state < 0:
                raise self._fail(phase, RuntimeError(f"Mooncake reports status {state} (is the peer gone?)"))
            if time.monotonic() > deadline:
                raise self._fail(phase, TimeoutError(f"not done after {self.timeout:.0f}s"))
            pause()


def _sources(trainer_metadata: list[dict[str, Any]]) -> dict[int, tuple[str, list[int]]]:
    """What a leader reads from: every trainer rank's session and slot addresses."""
    return {t: (m["session"], list(m["slots"])) for t, m in enumerate(trainer_metadata)}
