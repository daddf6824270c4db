"""Backend ``collective``: broadcast over standalone process groups; registered as
``gloo``, ``nccl`` and ``hccl``.

Topology for T trainer ranks and R rollout ranks (global ranks: trainers 0..T-1, then
rollouts T..T+R-1):

- one gloo *control* group of all T+R ranks (header, final status: small CPU messages);
- T *data* groups of the chosen backend, group i = {trainer i} + every rollout rank.
  Bucket b is owned by trainer b mod T and broadcast over group b mod T, so every trainer
  sends, and no trainer receives another's buckets.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from weightbus import comm
from weightbus.engines import sharded
from weightbus.engines.api import CheckpointEngineRegistry, agree_buffers, check_sides
from weightbus.engines.bucket import BucketEngine
from weightbus.errors import PlanError
from weightbus.packing import buffers
from weightbus.packing.shards import ShardBucket
from weightbus.plan import Bucket, BucketPlan


@CheckpointEngineRegistry.register("hccl", pg_backend="hccl")
@CheckpointEngineRegistry.register("nccl", pg_backend="nccl")
@CheckpointEngineRegistry.register("gloo", pg_backend="gloo")
class CollectiveEngine(BucketEngine):
    """Broadcast engine. ``pg_backend`` picks the data plane (``gloo`` moves host
    buckets, ``nccl``/``hccl`` device buckets)."""

    def __init__(self, bucket_size: int | None = None, *, pg_backend: str = "gloo", relay: int = 0,
                 **kwargs: Any):
        """``relay`` (sharded receive): 0, every rollout rank is sent its regions by the
        trainers; k >= 1, the ranks of one layout (rank r of every replica of one
        parallelism) form a k-ary tree (1: a chain) that forwards each bucket as it
        arrives, so the trainers send each shard once per layout, not once per replica.
        Every rank of a group states the same value."""
        if pg_backend == "gloo" and "device" not in kwargs:
            kwargs["device"] = "cpu"
        if isinstance(relay, bool) or not isinstance(relay, int) or relay < 0:
            raise PlanError(f"relay must be an int >= 0 (0: off, 1: a chain, k: a k-ary tree), got {relay!r}")
        super().__init__(bucket_size, **kwargs)
        if pg_backend == "nccl" and self.device.type != "cuda":
            raise PlanError(f"backend 'nccl' needs a CUDA device, got {self.device}")
        self.pg_backend = pg_backend
        self.relay = relay
        self._relaying: dict[int, list[Any]] = {}  # slot -> its forwards to relay children
        self._from: dict[int, int | None] = {}  # slot -> the relay rank it receives from
        self._slots: list[torch.Tensor] = []
        self._data: dict[int, Any] = {}  # trainer rank -> data group
        # relay: the rollout ranks' own group, for the odd hops of a relay tree (a member
        # receives over one group and forwards over the other: one group's point-to-point
        # operations share one NCCL stream, which would run a member's receive and its
        # forwards one after the other)
        self._relay_pg: Any = None
        self._inflight: dict[int, Any] = {}  # slot -> work of the last transfer through it
        self._held: dict[int, int] = {}  # slot -> the bucket it last sent (for errors)
        self._formed = 0  # how many times a group was formed under _formed_token
        self._formed_token = ""
        self._formed_with: dict[str, Any] | None = None  # init_process_group's arguments

    # --- lifecycle ---------------------------------------------------------------------
    def set_shard_destinations(self, placements: sharded.Placements | sharded.Destinations | None) -> None:
        """Rollout rank, before ``prepare()``: receive only these regions of the update
        tensors, point to point, each written straight where it lands. Either fixed
        placements, ``{name: [(Box, destination view of the box's shape), ...]}`` (a fused
        parameter lists one pair per source tensor; a replicated one the whole box), or a
        :class:`~weightbus.engines.sharded.Destinations` that states its layout per
        manifest and writes each region itself (vLLM's). A tensor a layout does not name
        arrives whole through the stream, as without placements (counted in
        ``UpdateStats.fallbacks``); one named with no region is not received. The group
        learns that it shards when it forms; ``None`` takes whole tensors again (form anew)."""
        if self.delta and placements is not None and not isinstance(placements, Mapping) \
                and not callable(getattr(placements, "region", None)):
            raise PlanError(f"{self.where()}: delta=True writes each change in place: sharded receive then "
                            f"needs destinations that are views (a mapping of placements, or Destinations "
                            f"with region()); {type(placements).__name__} places each region itself")
        if self.role == "trainer":
            raise PlanError(f"{self.where()}: only a rollout rank states shard destinations")
        self._shard_copies = {}  # (views of the destinations before)
        if placements is None or isinstance(placements, sharded.Destinations):
            self._shard_dests = placements
        elif isinstance(placements, Mapping):
            self._shard_dests = sharded.Placed(placements, self.where)
        else:
            raise PlanError(f"{self.where()}: shard destinations must be a mapping of placements or "
                            f"a Destinations (layout() and place()), got {type(placements).__name__}")

    def prepare(self) -> dict[str, Any]:
        # buckets are allocated once the group agrees on their size (init_process_group)
        meta = {"addr": comm.local_address(), "device": str(self.device), **self.buffer_metadata()}
        if self.pg_backend == "nccl":  # (checked by build_topology: NCCL hangs on a mismatch)
            meta["nccl_cumem"] = os.environ.get("NCCL_CUMEM_ENABLE", "1")
        if self._shard_dests is not None:
            meta["sharded"] = True
        meta["relay"] = self.relay
        return self._store_metadata(meta)

    def _allocate(self) -> None:
        if not self._slots:
            self._forget_views()
            self._slots = [buffers.allocate(self.bucket_size, self.device)
                           for _ in range(self.num_buffers)]

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list], dict[str, list]]:
        check_sides(trainer_world_size, rollout_world_size, metadata)
        _check_nccl_cumem(metadata)
        master = metadata[0]
        if "port" not in master:
            raise PlanError("metadata[0] must come from trainer rank 0 (it holds the rendezvous store)")
        common = {"trainer_world_size": trainer_world_size, "rollout_world_size": rollout_world_size,
                  "master_addr": master["addr"], "master_port": master["port"],
                  "token": master["token"], "bucket_size": agree_buffers(trainer_world_size, metadata)}
        T, R = trainer_world_size, rollout_world_size
        if any(m.get("sharded") for m in metadata[T:]):  # (the layouts travel with each update)
            common["sharded"] = True
        relays = {r: m.get("relay", 0) for r, m in enumerate(metadata)}
        if len(set(relays.values())) > 1:
            raise PlanError("the ranks state different relay values ("
                            + "; ".join(f"relay={v} on rank(s) {', '.join(map(str, rs))}"
                                        for v, rs in _ranks_by_value(relays).items())
                            + "): give every engine of the group the same one")
        if relays and relays[0]:
            common["relay"] = relays[0]
        trainer = {k: [v] * T for k, v in common.items()} | {"rank": list(range(T))}
        rollout = {k: [v] * R for k, v in common.items()} | {"rank": list(range(T, T + R))}
        return trainer, rollout

    def init_process_group(self, *, rank: int, trainer_world_size: int, rollout_world_size: int,
                           master_addr: str, master_port: int, token: str,
                           bucket_size: int | None = None, sharded: bool = False, relay: int = 0) -> None:
        """Join the groups. ``bucket_size`` is the size the group agreed on (see
        :func:`~weightbus.engines.base.agree_buffers`); this rank's buckets follow it.
        ``sharded``: a rollout rank stated shard destinations (every update agrees on the
        layouts, and moves regions point to point); ``relay``: the group's relay fan-out."""
        T, R = trainer_world_size, rollout_world_size
        if relay != self.relay:
            raise PlanError(f"{self.where()}: the group relays with relay={relay}, this engine was made "
                            f"with relay={self.relay}")
        args = dict(rank=rank, trainer_world_size=T, rollout_world_size=R, master_addr=master_addr,
                    master_port=master_port, token=token, bucket_size=bucket_size, sharded=bool(sharded),
                    relay=relay)
        self._sharding, self._layouts, self._shard_plans = bool(sharded), None, {}
        self._layout_seen = [(None, None)] * R
        if args == self.formation():  # (the same group again, healthy: keep it, buckets anew)
            self._allocate()
            return
        self._formed_with = None
        if bucket_size is not None and bucket_size != self.bucket_size:
            self._wait_all("resize buckets")
            self._bucket_size, self._slots = int(bucket_size), []
            self._plans.clear()
        self.rank, self.world_size = rank, T + R
        self.role = "trainer" if rank < T else "rollout"
        self.trainer_rank = rank if rank < T else -1
        self.n_senders = T
        self._drop_groups()
        if token != self._formed_token:
            self._formed_token, self._formed = token, 0
        self._formed += 1
        prefix = f"wb/{token}/{self._formed}"
        store = comm.connect_store(master_addr, master_port, self.timeout, self.where())
        self._store = store
        self._allocate()
        self._ctl = comm.new_group("gloo", store, f"{prefix}/ctl", rank, T + R, self.timeout,
                                   None, self.where())
        self._ctl_rank = rank
        owners = [rank] if rank < T else range(T)
        for i in owners:
            member = 0 if rank < T else 1 + rank - T
            self._data[i] = comm.new_group(self.pg_backend, store, f"{prefix}/data{i}", member,
                                           1 + R, self.timeout, self.device, self.where())
        if relay and R > 1 and rank >= T:
            self._relay_pg = comm.new_group(self.pg_backend, store, f"{prefix}/relay", rank - T, R,
                                            self.timeout, self.device, self.where())
        self._broken = None
        self._peers_fingerprint = None
        self._formed_with = args

    def formation(self) -> dict[str, Any] | None:
        if self._ctl is None or self._broken:
            return None
        return self._formed_with

    def rebuild_group(self, **kwargs: Any) -> None:
        """Drop and re-form the groups with the same rendezvous (all ranks call it)."""
        self._formed_with = None
        self.init_process_group(**kwargs)

    def _drop_groups(self) -> None:
        for pg in [self._ctl, *self._data.values(), self._relay_pg]:
            if pg is not None and hasattr(pg, "abort") and self._broken:
                try:
                    pg.abort()
                except Exception:  # noqa: BLE001 - already failed; nothing more to do
                    pass
        self._ctl, self._data, self._inflight, self._relaying = None, {}, {}, {}
        self._relay_pg = None

    def finalize(self, destroy_group: bool = False) -> None:
        self._wait_all("finalize")
        self._slots = []
        self._forget_views()
        if destroy_group:
            self._drop_groups()
            self._store_server, self._formed_with = None, None

    # --- transport hooks ---------------------------------------------------------------
    def _packs(self, b: Bucket) -> bool:
        return b.owner == self.trainer_rank

    def _owners(self, plan: BucketPlan, index: int) -> frozenset[int]:
        return plan.owners_of(index)

    def _wait(self, work: Any, phase: str) -> None:
        try:
            work.wait()
        except Exception as e:  # noqa: BLE001
            raise self._fail(phase, e) from e

    def _wait_all(self, phase: str) -> None:
        for s, work in list(self._inflight.items()):
            self._inflight.pop(s)
            if not self._broken:
                self._wait(work, phase)

    def _acquire(self, b: Bucket) -> torch.Tensor:
        self._allocate()  # (again after finalize(), which freed the buckets)
        # slots go by position among this rank's own buckets
        s = b.turn % self.num_buffers
        work = self._inflight.pop(s, None)
        if work is not None:
            self._wait(work, f"send bucket {self._held.get(s)} (before bucket {b.index} can reuse its slot)")
        self._held[s] = b.index
        return self._slots[s]

    def _send(self, b: Bucket | ShardBucket, slot: torch.Tensor) -> None:
        s = b.turn % self.num_buffers
        try:
            if isinstance(b, ShardBucket):  # to its one receiver, member 1 + r of the group
                self._inflight[s] = self._data[b.owner].send([slot[: b.wire_bytes]], 1 + b.receiver, 0)
            else:
                self._inflight[s] = comm.broadcast(self._data[b.owner], slot[: b.wire_bytes], 0)
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"send bucket {b.index}", e) from e

    def _flush_send(self, plan: BucketPlan) -> None:
        self._wait_all("send (flush)")

    def _hop(self, b: ShardBucket, peer: int, hop: int) -> tuple[Any, int]:
        """The group and the member that a relay hop into depth ``hop`` goes over: odd hops
        over the rollout ranks' relay group, even ones over the bucket's data group."""
        return (self._relay_pg, peer) if hop % 2 else (self._data[b.owner], 1 + peer)

    def _post_recv(self, b: Bucket | ShardBucket, src: int | None = None, hop: int = 0) -> None:
        """``src``: the rollout rank that relays ``b`` here (None: its trainer sends it),
        ``hop``: this rank's depth in its relay tree."""
        self._allocate()
        s = _slot_of(b, self.num_buffers)
        for work in self._relaying.pop(s, ()):  # (the slot's last bucket has left for the children)
            self._wait(work, f"relay onward (before slot {s} takes bucket {b.index})")
        try:
            if isinstance(b, ShardBucket):
                pg, peer = (self._data[b.owner], 0) if src is None else self._hop(b, src, hop)
                self._inflight[s] = pg.recv([self._slots[s][: b.wire_bytes]], peer, 0)
            else:
                self._inflight[s] = comm.broadcast(self._data[b.owner], self._slots[s][: b.wire_bytes], 0)
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"receive bucket {b.index} from {_whence(b, src)}", e) from e
        self._from[s] = src

    def _wait_recv(self, b: Bucket | ShardBucket) -> torch.Tensor:
        s = _slot_of(b, self.num_buffers)
        work = self._inflight.pop(s)
        self._wait(work, f"receive bucket {b.index} from {_whence(b, self._from.get(s))}")
        return self._slots[s]

    def _forward(self, b: ShardBucket, slot: torch.Tensor, to: int, hop: int = 1,
                 abort: bool = False) -> None:
        """Relay: start passing received bucket ``b`` on to rollout rank ``to``, at depth
        ``hop`` (the slot is reused only once this has left: ``_post_recv``). ``abort``: an
        abort notice in a scratch buffer, sent after this rank's own transfers failed."""
        try:
            pg, peer = self._hop(b, to, hop)
            work = pg.send([slot[: b.wire_bytes]], peer, 0)
        except Exception as e:  # noqa: BLE001
            raise self._fail(f"relay bucket {b.index} to rollout rank {to}", e) from e
        key = -1 if abort else _slot_of(b, self.num_buffers)
        self._relaying.setdefault(key, []).append(work)

    def _flush_forward(self, abort: bool = False) -> None:
        """Wait until every relayed bucket has left (``abort``: the notices only, whatever
        else failed)."""
        for s in ([-1] if abort else list(self._relaying)):
            for work in self._relaying.pop(s, ()):
                if abort:
                    work.wait()
                else:
                    self._wait(work, "relay onward (flush)")


def _whence(b: Bucket | ShardBucket, src: int | None) -> str:
    return f"trainer rank {b.owner}" if src is None else f"rollout rank {src} (relay)"


def _slot_of(b: Bucket | ShardBucket, num_buffers: int) -> int:
    """A receiver's slot for ``b``: by its position among the buckets this rank receives."""
    return (b.seq if isinstance(b, ShardBucket) else b.index) % num_buffers


def _ranks_by_value(said: dict[int, Any]) -> dict[Any, list[int]]:
    """Rank -> value, turned into value -> the ranks that state it (for errors that name who
    disagrees)."""
    by: dict[Any, list[int]] = {}
    for r, v in said.items():
        by.setdefault(v, []).append(r)
    return by


def _check_nccl_cumem(metadata: list[dict[str, Any]]) -> None:
    """NCCL's peers must agree on ``NCCL_CUMEM_ENABLE`` (how they map each other's buffers):
    ranks that differ hang while the communicator forms. Inference engines set it in their
    own processes (SGLang and vLLM: 0) where a trainer may not; refused on every rank, naming
    who holds which value, before any group forms."""
    said = {r: m["nccl_cumem"] for r, m in enumerate(metadata) if "nccl_cumem" in m}
    if len(set(said.values())) > 1:
        raise PlanError("NCCL_CUMEM_ENABLE differs between the ranks of the nccl group ("
                        + "; ".join(f"{v!r} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                                    for v, r in _ranks_by_value(said).items())
                        + "): NCCL hangs while forming such a group; set the same value in every process "
                          "(SGLang and vLLM run with NCCL_CUMEM_ENABLE=0: export it for the trainer too)")
