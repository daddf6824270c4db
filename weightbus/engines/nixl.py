"""Backend ``nixl``: pipelined chains (or trees) of one-sided NIXL writes between registered
bucket slots (UCX: host memory anywhere, device memory where NIXL has CUDA).

Topology, T trainer ranks and R rollout ranks: one tree per trainer rank over all R rollout
ranks, its shape picked by :mod:`weightbus.topology` from the ranks' link rates (a chain
when they are equal or unknown)::

    chain i:   trainer i -> rollout i%R -> rollout (i+1)%R -> ...           (R hops)
    tree i:    trainer i -> f0 heads, each forwarding to f1 children ...   (fewer hops)
    direct:    trainer i -> every rollout                                   (no forwarding)

Bucket b travels down tree b mod T (its owner's). Every trainer rank's link carries its own
share of the model once per head, whatever R is; each rollout forwards bucket b to its
children while it unpacks it, so another receiver adds one hop of latency at most, not a
model's worth of time. Trees start at different rollouts, so the forwarding work is spread.

Every rank registers a ring of S = ``num_buffers`` slots; bucket b lands in slot b mod S on
every rollout. The writer of a slot must hold a *credit* for it: a rollout that is done with
bucket b-S (unpacked, and forwarded) sends "credit b" to whoever writes bucket b into it (its
upstream in tree b mod T); the first S credits go out when an update starts. Data and
credits are NIXL notifications tagged with the group's formation and the version (and
known by their sender), so nothing from a failed update is mistaken for the next one.
Header and final status travel over the core's gloo control group, like every engine's, so
a failure anywhere fails the update on every rank, and every wait has the engine's deadline.

NIXL (``pip install 'weightbus[nixl]'``) does the moving: we only decide who writes which
slot when, which no NIXL API covers.
"""

from __future__ import annotations

import os
import secrets
import time
from typing import Any

import torch

from weightbus import buffers, comm, config
from weightbus import topology as topology_mod
from weightbus.engines.base import BucketEngine, CheckpointEngineRegistry, agree_buffers, check_sides
from weightbus.errors import PlanError, WeightSyncError
from weightbus.plan import Bucket, BucketPlan

#: seconds a wait sleeps between polls: short next to a bucket's transfer, long enough to
#: leave the CPU to UCX's own threads and to the peer processes on the host
_SPIN = 50e-6


def _nixl_api() -> Any:
    """NIXL's Python API, or an error that says how to get it."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config  # the meta package picks the build
    except ImportError:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
        except ImportError:
            try:
                from nixl_cu13._api import nixl_agent, nixl_agent_config  # type: ignore[no-redef]
            except ImportError:
                raise PlanError("backend 'nixl' needs NIXL: pip install 'weightbus[nixl]' (or "
                                "nixl-cu12 / nixl-cu13 for your CUDA)") from None
    return nixl_agent, nixl_agent_config


@CheckpointEngineRegistry.register("nixl")
class NixlEngine(BucketEngine):
    """Chains (or trees) of NIXL one-sided writes (see the module doc).

    Args (besides the common ones):
        topology: ``auto`` (default: from the ranks' ``link_gbps``; a chain when they are
            equal or not given), ``chain``, ``tree`` (binary) or ``direct`` (each trainer
            rank writes to every rollout rank). Every rank gives the same.
        link_gbps: this rank's link rate (GB/s), for ``auto``.
    """

    def __init__(self, bucket_size: int | None = None, *, topology: str = "auto",
                 link_gbps: float | None = None, **kwargs: Any):
        self._api = _nixl_api()  # fails here, naming the extra, not at the first update
        super().__init__(bucket_size, **kwargs)
        topology_mod.choose(1, 1, kind=topology)  # checked here, where it is given
        self.topology = topology
        self.link_gbps = None if link_gbps is None else \
            config.positive_seconds(link_gbps, "link_gbps", "GB/s")
        self.fanout: topology_mod.Fanout | None = None  # what the group agreed on
        self._routes: dict[int, tuple[int | None, list[int]]] = {}  # tree -> (upstream, downstream)
        self._rank_of: dict[str, int] = {}  # peer agent name -> its rank
        self._agent: Any = None
        self._agent_name = ""
        self._reg: Any = None
        self._slots: list[torch.Tensor] = []
        self._store_server: Any = None
        self._token = ""
        self._formed = 0
        self._formed_token = ""
        self._peers: dict[int, tuple[str, list[tuple[int, int, int]]]] = {}  # rank -> (agent, slots)
        self._inbox: set[tuple[str, int, int]] = set()  # ("d" | "c", bucket, from rank): this update
        self._tag = ""  # formation/version of the current update
        self._writes: dict[Any, Any] = {}  # key -> (handle, peer, bucket, state) not yet waited on
        self.T = self.R = 1
        self._group_tag = ""
        self._abort_reason = ""  # a neighbour's failure, told to us
        self._told_abort = False

    # --- lifecycle ---------------------------------------------------------------------
    @property
    def _mem(self) -> str:
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    def prepare(self) -> dict[str, Any]:
        self._register()
        meta: dict[str, Any] = {"addr": comm.local_address(), "device": str(self.device),
                                **self.buffer_metadata(), "agent": self._agent_name,
                                "nixl": self._agent.get_agent_metadata(),
                                "slots": [self._desc(s) for s in self._slots],
                                "topology": self.topology, "link_gbps": self.link_gbps}
        if self.role != "rollout":
            if self._store_server is None:
                self._store_server = comm.serve_store(self.timeout)
            self._token = f"{self._store_server.port}-{id(self):x}-{secrets.token_hex(6)}"
            meta.update(port=self._store_server.port, token=self._token)
        return meta

    def _desc(self, t: torch.Tensor) -> tuple[int, int, int]:
        return (t.data_ptr(), t.numel(), t.device.index or 0)

    def _register(self) -> None:
        """A new agent for every formation, with the slots registered to it. Slots are
        sized from this rank's own bucket size (the group may agree on a smaller one: a slot
        larger than a bucket is fine) and kept while they are large enough.

        A new agent, not the old one with peers removed and added again: NIXL (1.5, UCX)
        keeps a connection's descriptors after ``remove_remote_agent``, so a long job whose
        replicas come and go would run out of them; dropping the agent frees them all."""
        keep = self._slots if self._slots and self._slots[0].numel() >= self.bucket_size else []
        self._drop_agent()
        nixl_agent, nixl_agent_config = self._api
        self._agent_name = f"wb-{os.getpid()}-{id(self):x}-{secrets.token_hex(4)}"
        self._agent = nixl_agent(self._agent_name, nixl_agent_config(backends=["UCX"]))
        if not keep:
            keep = [buffers.allocate(self.bucket_size, self.device) for _ in range(self.num_buffers)]
            self._forget_views()
        self._slots = keep
        self._reg = self._agent.register_memory(self._slots)

    @classmethod
    def build_topology(cls, trainer_world_size: int, rollout_world_size: int,
                       metadata: list[dict[str, Any]]) -> tuple[dict[str, list], dict[str, list]]:
        T, R = trainer_world_size, rollout_world_size
        check_sides(T, R, metadata)
        if "port" not in metadata[0]:
            raise PlanError("metadata[0] must come from trainer rank 0 (it holds the rendezvous store)")
        kinds = {m.get("topology", "auto") for m in metadata}
        if len(kinds) > 1:
            raise PlanError(f"the ranks disagree on topology: {sorted(kinds)}; give every rank the same")
        rates = [m.get("link_gbps") for m in metadata]
        fan = topology_mod.choose(T, R, kind=kinds.pop(),
                                  sender_gbps=None if None in rates[:T] else min(rates[:T]),
                                  receiver_gbps=None if None in rates[T:] else min(rates[T:]))
        common = {"trainer_world_size": T, "rollout_world_size": R, "master_addr": metadata[0]["addr"],
                  "master_port": metadata[0]["port"], "token": metadata[0]["token"],
                  "bucket_size": agree_buffers(T, metadata), "fanout": (fan.sender, fan.relay)}
        routes: dict[int, dict[int, tuple[int | None, list[int]]]] = {r: {} for r in range(T + R)}
        for c in range(T):  # tree c carries trainer c's buckets
            heads, children = topology_mod.layout(c, R, fan)
            parent = topology_mod.parent_of(c, R, fan)
            routes[c][c] = (None, [T + h for h in heads])
            for x in range(R):
                up = parent[x]
                routes[T + x][c] = (c if up is None else T + up, [T + y for y in children[x]])

        def peers(rank: int) -> dict[int, tuple[str, bytes, list]]:
            # a rank talks to its neighbours in every tree only
            near = {p for up, down in routes[rank].values() for p in [up, *down] if p is not None}
            return {p: (metadata[p]["agent"], metadata[p]["nixl"], metadata[p]["slots"]) for p in near}

        def side(rs: list[int]) -> dict[str, list]:
            per_rank = {"rank": rs, "peers": [peers(r) for r in rs], "routes": [routes[r] for r in rs]}
            return {k: [v] * len(rs) for k, v in common.items()} | per_rank
        ranks = list(range(T + R))
        return side(ranks[:T]), side(ranks[T:])

    def init_process_group(self, *, rank: int, trainer_world_size: int, rollout_world_size: int,
                           master_addr: str, master_port: int, token: str, peers: dict[int, Any],
                           routes: dict[int, tuple[int | None, list[int]]],
                           fanout: tuple[int, int] = (1, 1), bucket_size: int | None = None) -> None:
        """``routes``: for every trainer rank's tree, this rank's (upstream, downstream
        ranks); ``fanout``: the tree's shape the group agreed on."""
        T, R = trainer_world_size, rollout_world_size
        self._take_place(rank, T, R, bucket_size)
        self._drop_group()
        self.fanout = topology_mod.Fanout(*fanout)
        self._routes = {int(c): (up, list(down)) for c, (up, down) in routes.items()}
        if token != self._formed_token:
            self._formed_token, self._formed = token, 0
        self._formed += 1
        prefix = f"wb/{token}/{self._formed}"
        for p, (name, agent_meta, slots) in peers.items():
            try:
                self._agent.add_remote_agent(agent_meta)
            except Exception as e:  # noqa: BLE001 - e.g. UCX cannot reach it: it is gone
                self._drop_group()
                raise WeightSyncError(f"{self.where()}: forming the group: cannot connect to "
                                      f"{self._who_in(p, T)}'s NIXL agent {name!r}: {e}") from e
            self._peers[p] = (name, [tuple(s) for s in slots])
            self._rank_of[name] = p
        self._store = comm.connect_store(master_addr, master_port, self.timeout, self.where())
        self._ctl = comm.new_group("gloo", self._store, f"{prefix}/ctl", rank, T + R, self.timeout,
                                   None, self.where())
        self._ctl_rank = rank
        self._broken = None
        self._peers_fingerprint = None
        self._group_tag = f"{token}/{self._formed}"
        self._abort_reason, self._told_abort = "", False

    rebuild_group = init_process_group

    def _drop_group(self) -> None:
        self._wait_writes(None)
        for name, _ in self._peers.values():
            try:
                self._agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - gone already
                pass
        self._peers, self._rank_of = {}, {}
        if self._ctl is not None and self._broken:
            try:
                self._ctl.abort()
            except Exception:  # noqa: BLE001 - it failed already
                pass
        self._ctl = None

    def _drop_agent(self) -> None:
        """Writes in flight end, the agent goes (and every connection with it)."""
        if self._agent is not None:
            self._drop_group()
            try:
                if self._reg is not None:
                    self._agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._agent, self._reg = None, None

    def _teardown_agent(self) -> None:
        self._drop_agent()
        self._slots = []
        self._forget_views()

    def finalize(self, destroy_group: bool = False) -> None:
        if destroy_group:
            self._teardown_agent()
            self._store_server = None
        else:
            self._wait_writes(None)

    # --- the current update's tag and mailbox ----------------------------------------
    def _begin(self, version: int) -> None:
        self._tag = f"{self._group_tag}/{version}"
        self._inbox.clear()

    def _poll(self) -> None:
        prefix = self._tag + "/"
        try:
            notes = self._agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001
            raise self._fail("reading notifications", e) from e
        for agent, msgs in notes.items():
            for m in msgs:
                kind, _, rest = m.decode(errors="replace").partition(":")
                if kind == "a" and rest.startswith(self._group_tag + "/"):
                    self._abort_reason = self._abort_reason or rest[len(self._group_tag) + 1:]
                elif rest.startswith(prefix):  # anything else is from an update that failed
                    self._inbox.add((kind, int(rest[len(prefix):]), self._rank_of.get(agent, -1)))

    def _fail(self, phase: str, e: BaseException) -> Any:
        """A failure here is also told to every neighbour at once (a chain has no collective
        that would carry it), so theirs waits end now, with our reason, not at their deadline."""
        err = super()._fail(phase, e)
        if not self._told_abort and self._agent is not None:
            self._told_abort = True
            note = f"a:{self._group_tag}/{str(err)[:512]}".encode()
            for name, _ in self._peers.values():
                try:
                    self._agent.send_notif(name, note)
                except Exception:  # noqa: BLE001 - best effort: it may be the one gone
                    pass
        return err

    def _await(self, kind: str, b: int, peer: int, phase: str) -> None:
        deadline = time.monotonic() + self.timeout
        key = (kind, b, peer)
        while key not in self._inbox:
            self._progress()
            self._poll()
            if key in self._inbox:
                break
            if self._abort_reason:
                raise self._fail(phase, RuntimeError(f"a peer aborted: {self._abort_reason}"))
            if time.monotonic() > deadline:
                raise self._fail(phase, TimeoutError(
                    f"no {'data' if kind == 'd' else 'credit'} for bucket {b} from "
                    f"{self._who(peer)} within {self.timeout:.0f}s"))
            time.sleep(_SPIN)
        self._inbox.discard(key)

    def _progress(self) -> None:
        """Drive our writes in flight: UCX moves a write (and delivers its notification)
        only while its initiator asks for its state; a write that failed fails the update
        now, naming the peer."""
        for key, (handle, peer, b, state) in list(self._writes.items()):
            if state == "PROC":
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as e:  # noqa: BLE001 - NIXL raises when the peer is gone
                    state = f"ERR ({type(e).__name__}: {e})"
                self._writes[key] = (handle, peer, b, state)
            if state not in ("PROC", "DONE"):
                self._writes.pop(key)
                self._release_handle(handle)
                raise self._fail(f"write bucket {b} to {self._who(peer)}",
                                 RuntimeError(f"NIXL reports {state} (is it gone?)"))

    def _who(self, rank: int) -> str:
        return self._who_in(rank, self.T)

    @staticmethod
    def _who_in(rank: int, T: int) -> str:
        return f"trainer rank {rank}" if rank < T else f"rollout rank {rank - T}"

    def _notify(self, peer: int, kind: str, b: int) -> None:
        try:
            self._agent.send_notif(self._peers[peer][0], f"{kind}:{self._tag}/{b}".encode())
        except Exception as e:  # noqa: BLE001 - NIXL raises when the peer is gone
            raise self._fail(f"credit for bucket {b} to {self._who(peer)}", e) from e

    def _write(self, key: Any, src: torch.Tensor, peer: int, b: Bucket) -> None:
        """Post a write of ``src`` into ``peer``'s slot for bucket ``b``; the notification
        that it landed travels with it."""
        name, slots = self._peers[peer]
        addr, _, dev = slots[b.index % len(slots)]
        try:
            mine = (src.data_ptr(), b.wire_bytes, src.device.index or 0)
            local = self._agent.get_xfer_descs([mine], self._mem)
            remote = self._agent.get_xfer_descs([(addr, b.wire_bytes, dev)], self._mem)
            note = f"d:{self._tag}/{b.index}".encode()
            handle = self._agent.initialize_xfer("WRITE", local, remote, name, note)
        except Exception as e:  # noqa: BLE001 - NIXL raises when the peer is gone
            raise self._fail(f"write bucket {b.index} to {self._who(peer)}", e) from e
        try:
            state = self._agent.transfer(handle)
        except Exception as e:  # noqa: BLE001
            self._release_handle(handle)
            raise self._fail(f"write bucket {b.index} to {self._who(peer)}", e) from e
        if state == "ERR":
            self._release_handle(handle)
            raise self._fail(f"write bucket {b.index} to {self._who(peer)}",
                             RuntimeError("NIXL refused the transfer"))
        self._writes[key] = (handle, peer, b.index, state)

    def _wait_writes(self, key: Any) -> None:
        """Until the writes whose keys start with ``key`` (None: every write) have landed."""
        keys = list(self._writes) if key is None else [k for k in self._writes if k[:len(key)] == key]
        for k in keys:
            deadline = time.monotonic() + self.timeout
            while k in self._writes and self._writes[k][3] == "PROC":
                try:
                    self._progress()
                except Exception:
                    if key is None and self._broken:
                        break  # tearing down after a failure
                    raise
                if k in self._writes and self._writes[k][3] == "PROC":
                    if time.monotonic() > deadline:
                        _, peer, b, _ = self._writes[k]
                        raise self._fail(f"write bucket {b} to {self._who(peer)}",
                                         TimeoutError(f"still in flight after {self.timeout:.0f}s"))
                    time.sleep(_SPIN)
            if k in self._writes:
                self._release_handle(self._writes.pop(k)[0])

    def _release_handle(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - released with the agent anyway
            pass

    # --- transport hooks ---------------------------------------------------------------
    def _packs(self, b: Bucket) -> bool:
        return b.owner == self.trainer_rank

    def _owners(self, plan: BucketPlan, index: int) -> frozenset[int]:
        return plan.owners_of(index)

    def _acquire(self, b: Bucket) -> torch.Tensor:
        s = (b.index // self.T) % self.num_buffers  # this trainer's own buckets, in turn
        self._wait_writes(("out", s))
        return self._slots[s]

    def _send(self, b: Bucket, slot: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # packed before NIXL reads it
        for head in self._routes[b.owner][1]:
            self._await("c", b.index, head, f"send bucket {b.index} to {self._who(head)}: waiting for "
                                            f"a free slot")
            self._write(("out", (b.index // self.T) % self.num_buffers, head), slot, head, b)

    def _flush_send(self, plan: BucketPlan) -> None:
        self._wait_writes(None)

    def _post_recv(self, b: Bucket) -> None:
        # slot b mod S is free here: whoever writes bucket b into it may go ahead
        self._notify(self._routes[b.owner][0], "c", b.index)  # type: ignore[arg-type]

    def _wait_recv(self, b: Bucket) -> torch.Tensor:
        up, down = self._routes[b.owner]
        self._await("d", b.index, up, f"receive bucket {b.index} from {self._who(up)}")  # type: ignore[arg-type]
        slot = self._slots[b.index % self.num_buffers]
        for nxt in down:  # pass it on while we unpack it
            self._await("c", b.index, nxt, f"forward bucket {b.index} to {self._who(nxt)}")
            self._write(("fwd", b.index, nxt), slot, nxt, b)
        return slot

    def _release(self, b: Bucket) -> None:
        self._wait_writes(("fwd", b.index))  # forwarded before the slot is offered again
        if self.device.type == "cuda":  # and unpacked: the copies out of it have run
            torch.cuda.current_stream(self.device).synchronize()

    def _flush_recv(self, plan: BucketPlan) -> None:
        self._wait_writes(None)
