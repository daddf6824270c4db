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
a slot only when every leader has acked its previous bucket. The small words (ready, ack)
travel as gloo point-to-point messages of the core's control group, tagged with the
version; the header and the final status are the core's, so a failure anywhere fails the
update on every rank, and every wait has the engine's deadline.

No metadata service is needed: the transfer engines meet with Mooncake's peer-to-peer
handshake (``P2PHANDSHAKE``), each side naming itself ``host:rpc_port``; the slot addresses
travel in ``prepare()``'s metadata. A rank joining or leaving changes only the control
group: the engines connect on demand, and a replica that is gone is simply not read for.

Mooncake (``pip install 'weightbus[mooncake]'``, the ``non-cuda`` build on machines without
CUDA; it needs ``libibverbs1``) does the moving; we decide who reads which slot when, which
no Mooncake API covers.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import torch

from weightbus import buffers, comm, config
from weightbus.engines.base import BucketEngine, CheckpointEngineRegistry, agree_buffers, check_sides
from weightbus.errors import PlanError, WeightSyncError
from weightbus.plan import Bucket, BucketPlan

#: seconds between polls of a read in flight
_SPIN = 50e-6
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
class MooncakeEngine(BucketEngine):
    """Replica leaders read buckets from the trainer ranks and relay them inside their
    replica (see the module doc).

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
        self._store_server: Any = None
        self._token = ""
        self._formed = 0
        self._formed_token = ""
        self.T = self.R = 1
        self._sources: dict[int, tuple[str, list[int]]] = {}  # trainer -> (session, slot addrs)
        self._leaders: list[int] = []  # global ranks of the replica leaders
        self._is_leader = False
        self._replica: Any = None  # the replica's own group (k > 1)
        self._replica_rank = 0
        self._version = 0
        self._words: dict[tuple[int, int], tuple[Any, torch.Tensor]] = {}  # (peer, bucket) -> recv
        self._sent: list[tuple[Any, torch.Tensor]] = []  # isends in flight (tensors kept alive)

    # --- lifecycle ---------------------------------------------------------------------
    def prepare(self) -> dict[str, Any]:
        self._open()
        meta: dict[str, Any] = {"addr": comm.local_address(), "device": str(self.device),
                                **self.buffer_metadata(), "session": self._session,
                                "slots": [s.data_ptr() for s in self._slots],
                                "replica_size": self.replica_size, "replica": self.replica}
        if self.role != "rollout":
            if self._store_server is None:
                self._store_server = comm.serve_store(self.timeout)
            self._token = f"{self._store_server.port}-{id(self):x}-{secrets.token_hex(6)}"
            meta.update(port=self._store_server.port, token=self._token)
        return meta

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
        replicas = _replicas([m.get("replica") for m in metadata[T:]],
                             [m.get("replica_size", 1) for m in metadata[T:]])
        common = {"trainer_world_size": T, "rollout_world_size": R, "master_addr": metadata[0]["addr"],
                  "master_port": metadata[0]["port"], "token": metadata[0]["token"],
                  "bucket_size": agree_buffers(T, metadata),
                  "leaders": [T + first for first, _ in replicas]}
        sources = {t: (metadata[t]["session"], list(metadata[t]["slots"])) for t in range(T)}
        mine = [(j, r - first, size) for j, (first, size) in enumerate(replicas)
                for r in range(first, first + size)]
        trainer = {key: [v] * T for key, v in common.items()} | {"rank": list(range(T)), "sources": [{}] * T,
                                                                 "replica": [None] * T}
        rollout = {key: [v] * R for key, v in common.items()} | {
            "rank": list(range(T, T + R)), "replica": mine,
            "sources": [sources if me[1] == 0 else {} for me in mine]}  # the leaders read
        return trainer, rollout

    def init_process_group(self, *, rank: int, trainer_world_size: int, rollout_world_size: int,
                           master_addr: str, master_port: int, token: str, leaders: list[int],
                           replica: tuple[int, int, int] | None = None, sources: dict[int, Any] | None = None,
                           bucket_size: int | None = None) -> None:
        """``leaders``: global ranks of the replica leaders; ``replica``: (index, rank in
        it, size) of this rollout rank's replica; ``sources``: a leader's trainer slots."""
        T, R = trainer_world_size, rollout_world_size
        self._take_place(rank, T, R, bucket_size)
        self._drop_group()
        self._sources = {int(t): (s, list(a)) for t, (s, a) in (sources or {}).items()}
        self._leaders = list(leaders)
        self._is_leader = replica is not None and replica[1] == 0
        if token != self._formed_token:
            self._formed_token, self._formed = token, 0
        self._formed += 1
        prefix = f"wb/{token}/{self._formed}"
        self._store = comm.connect_store(master_addr, master_port, self.timeout, self.where())
        self._ctl = comm.new_group("gloo", self._store, f"{prefix}/ctl", rank, T + R, self.timeout,
                                   None, self.where())
        self._ctl_rank = rank
        if replica is not None and replica[2] > 1:
            j, self._replica_rank, k = replica
            self._replica = comm.new_group("gloo", self._store, f"{prefix}/replica{j}", self._replica_rank,
                                           k, self.timeout, None, self.where())
        self._broken = None
        self._peers_fingerprint = None

    rebuild_group = init_process_group

    def _drop_group(self) -> None:
        for pg in (self._ctl, self._replica):
            if pg is not None and self._broken:
                try:
                    pg.abort()
                except Exception:  # noqa: BLE001 - it failed already
                    pass
        self._ctl, self._replica, self._replica_rank = None, None, 0
        self._words, self._sent = {}, []

    def finalize(self, destroy_group: bool = False) -> None:
        if destroy_group:
            self._drop_group()
            self._unregister()
            self._slots, self._te, self._store_server = [], None, None
            self._forget_views()

    # --- control words -------------------------------------------------------------------
    def _who(self, rank: int) -> str:
        return f"trainer rank {rank}" if rank < self.T else f"rollout rank {rank - self.T}"

    def _word(self, b: int) -> torch.Tensor:
        return torch.tensor([self._version, b], dtype=torch.int64)

    def _tell(self, peer: int, tag: int, b: int) -> None:
        w = self._word(b)
        try:
            self._sent.append((self._ctl.send([w], peer, tag), w))
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"telling {self._who(peer)} about bucket {b}", e) from e

    def _expect(self, peer: int, tag: int, b: int) -> None:
        """Post the receive of ``peer``'s word about bucket ``b``."""
        w = torch.empty(2, dtype=torch.int64)
        try:
            self._words[(peer, b)] = (self._ctl.recv([w], peer, tag), w)
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"waiting for {self._who(peer)} about bucket {b}", e) from e

    def _await_word(self, peer: int, b: int, phase: str) -> None:
        work, w = self._words.pop((peer, b))
        self._ctl_wait(work, phase)  # the control group's deadline
        got = w.tolist()
        if got != [self._version, b]:
            raise self._fail(phase, RuntimeError(f"{self._who(peer)} sent version {got[0]} bucket "
                                                 f"{got[1]}; expected version {self._version} bucket {b}"))

    def _drain_sent(self) -> None:
        sent, self._sent = self._sent, []
        for work, _ in sent:
            self._ctl_wait(work, "sending a control word")

    def _begin(self, version: int) -> None:
        self._version = version
        self._words.clear()

    # --- transport hooks ---------------------------------------------------------------
    def _slot_of(self, b: Bucket) -> int:
        return (b.index // self.T) % self.num_buffers  # an owner's own buckets, in turn

    def _packs(self, b: Bucket) -> bool:
        return b.owner == self.trainer_rank

    def _owners(self, plan: BucketPlan, index: int) -> frozenset[int]:
        return plan.owners_of(index)

    def _acquire(self, b: Bucket) -> torch.Tensor:
        prev = b.index - self.T * self.num_buffers  # the bucket this slot held last
        if prev >= 0:
            for leader in self._leaders:
                self._await_word(leader, prev, f"send bucket {b.index}: waiting for "
                                               f"{self._who(leader)} to read bucket {prev}")
        return self._slots[self._slot_of(b)]

    def _send(self, b: Bucket, slot: torch.Tensor) -> None:
        for leader in self._leaders:
            self._expect(leader, _ACK, b.index)
            self._tell(leader, _READY, b.index)

    def _flush_send(self, plan: BucketPlan) -> None:
        for b in plan.buckets:  # the last reads of every slot: done before the slots are reused
            if b.owner == self.trainer_rank and b.index + self.T * self.num_buffers >= len(plan):
                for leader in self._leaders:
                    self._await_word(leader, b.index, f"waiting for {self._who(leader)} to read "
                                                      f"bucket {b.index}")
        self._drain_sent()

    def _post_recv(self, b: Bucket) -> None:
        if self._is_leader:
            self._expect(b.owner, _READY, b.index)

    def _wait_recv(self, b: Bucket) -> torch.Tensor:
        slot = self._slots[b.index % self.num_buffers]
        if self._is_leader:
            owner = b.owner
            self._await_word(owner, b.index, f"receive bucket {b.index}: waiting for {self._who(owner)}")
            self._read(owner, b, slot)
            self._tell(owner, _ACK, b.index)
        if self._replica is not None:
            self._ctl_wait(comm.broadcast(self._replica, slot[:b.wire_bytes], 0),
                           f"relay bucket {b.index} inside the replica")
        return slot

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
            time.sleep(_SPIN)

    def _flush_recv(self, plan: BucketPlan) -> None:
        self._drain_sent()


def _replicas(names: list[Any], sizes: list[int]) -> list[tuple[int, int]]:
    """(first rollout rank, size) of every replica. Rollout ranks that name their replica
    (``engine.replica``, which the manager sets) are grouped by name (a replica's ranks are
    consecutive); otherwise every ``replica_size`` consecutive ranks form one."""
    if names and all(n is not None for n in names):
        out: list[tuple[int, int]] = []
        for r, n in enumerate(names):
            if r and n == names[r - 1]:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            elif n in names[:r]:
                raise PlanError(f"the ranks of replica {n!r} are not consecutive among the rollout ranks")
            else:
                out.append((r, 1))
        return out
    if len(set(sizes)) != 1:
        raise PlanError(f"the rollout ranks disagree on replica_size: {sorted(set(sizes))}")
    k, R = sizes[0], len(sizes)
    if R % k:
        raise PlanError(f"{R} rollout ranks do not split into replicas of {k}")
    return [(first, k) for first in range(0, R, k)]
