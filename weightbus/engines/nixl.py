"""Backend ``nixl``: pipelined chains (or trees) of one-sided NIXL writes between registered
bucket slots (UCX: host memory anywhere, device memory where NIXL has CUDA).

Topology, T trainer ranks and R rollout ranks: one tree per trainer rank over all R rollout
ranks, its shape picked by :mod:`weightbus.planning.topology` from the ranks' link rates (a chain
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
credits are NIXL notifications tagged with the update (trainer rank 0 numbers them), so
nothing from a failed update is mistaken for the next one.

Control plane: every replica is linked to the trainers on its own (:mod:`links`). Linked
ranks tell the trainers their agent and slots; with each header trainer rank 0 tells each
link its ranks' routes (when they changed), laid out over the replicas in the order they
were linked. So a join, a leave or a death changes only the routes, and the connections,
of that replica's neighbours. Mid-update, a rank that waits too long on a neighbour pings
it; one that does not answer is gone: the ranks above it complete the update without it,
the ranks below it fail theirs at once (told down their trees), and every replica agrees
its outcome over its own link (see ``docs/backends/nixl.md``).

NIXL (``pip install 'weightbus[nixl]'``) does the moving: we only decide who writes which
slot when, which no NIXL API covers.
"""

from __future__ import annotations

import logging
import os
import pickle  # control words among our own ranks
import secrets
import sys
import time
import types
from typing import Any

import torch

from weightbus import comm, config
from weightbus.engines.api import CheckpointEngineRegistry, agree_buffers, check_sides
from weightbus.engines.links import LinkedEngine, close, link_topology, replicas_of
from weightbus.errors import PlanError, TransferFailed
from weightbus.packing import buffers
from weightbus.plan import Bucket, BucketPlan
from weightbus.planning import topology as topology_mod

_log = logging.getLogger("weightbus")



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


#: microseconds NIXL's progress thread sleeps between its polls (WEIGHTBUS_NIXL_PROGRESS_US)
_PROGRESS_US = 100


def _new_agent(nixl_agent: Any, nixl_agent_config: Any, name: str) -> Any:
    """A NIXL agent (UCX) whose progress thread sleeps between its polls.

    The thread moves the bytes a peer writes into this agent's memory (over TCP or shared
    memory nothing else does while this rank is not polling) and its notifications. NIXL's
    Python API (1.5) runs it with no pause at all: a core busy for as long as the agent
    lives, between updates too (5.0 CPU-s of 5 s idle; 0.1 at 100 us). The pause is a field
    of the C++ config that API fills in and does not expose; its view of the bindings is
    wrapped while it builds this one agent. ``WEIGHTBUS_NIXL_PROGRESS_US=0``: NIXL's own."""
    delay = config.env_integer("WEIGHTBUS_NIXL_PROGRESS_US", minimum=0, maximum=1_000_000)
    delay = _PROGRESS_US if delay is None else delay
    api = sys.modules.get(nixl_agent.__module__)
    bind = getattr(api, "nixlBind", None)
    if not delay or bind is None or not hasattr(bind, "nixlAgent"):
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))

    def agent_with_delay(agent_name: str, cfg: Any) -> Any:
        cfg.pthrDelay = delay
        return bind.nixlAgent(agent_name, cfg)
    shim = types.SimpleNamespace(**{k: getattr(bind, k) for k in dir(bind) if not k.startswith("__")})
    shim.nixlAgent = agent_with_delay
    api.nixlBind = shim  # type: ignore[union-attr]
    try:
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    finally:
        api.nixlBind = bind  # type: ignore[union-attr]


@CheckpointEngineRegistry.register("nixl")
class NixlEngine(LinkedEngine):
    """Chains (or trees) of NIXL one-sided writes (see the module doc). Elastic: replicas
    are linked to the trainers one by one (:meth:`link_replicas`, :meth:`attach`), and a
    join, leave or death changes only its neighbours' connections (:attr:`connections`).

    Args (besides the common ones):
        topology: ``auto`` (default: from the ranks' ``link_gbps``; a chain when they are
            equal or not given), ``chain``, ``tree`` (binary) or ``direct`` (each trainer
            rank writes to every rollout rank). Every rank gives the same.
        link_gbps: this rank's link rate (GB/s), for ``auto``.
    """

    greets = True

    def __init__(self, bucket_size: int | None = None, *, topology: str = "auto",
                 link_gbps: float | None = None, **kwargs: Any):
        self._api = _nixl_api()  # fails here, naming the extra, not at the first update
        super().__init__(bucket_size, **kwargs)
        topology_mod.choose(1, 1, kind=topology)  # checked here, where it is given
        self.topology = topology
        self.link_gbps = None if link_gbps is None else \
            config.positive_seconds(link_gbps, "link_gbps", "GB/s")
        self.fanout: topology_mod.Fanout | None = None  # the shape of the current update's trees
        self._routes: dict[int, tuple[str | None, list[str]]] = {}  # tree -> (upstream, downstream) agents
        self._route_error = ""  # a neighbour this rank could not connect to
        self._alive: dict[str, float] = {}  # neighbour -> when it last answered a ping
        self._gone: dict[str, str] = {}  # ranks found dead or hung (by us or told) -> why
        self._link_of: dict[str, Any] = {}  # trainer: a rollout rank's agent -> its link
        self._agent: Any = None
        self._agent_name = ""
        self._reg: Any = None
        self._slots: list[torch.Tensor] = []
        self._peers: dict[str, list[tuple[int, int, int]]] = {}  # connected agent -> its slots
        self._labels: dict[str, str] = {}  # agent -> who it is, for errors
        self._connected: dict[str, int] = {}  # agent -> the serial its connection was made under
        self._connections = 0
        self._updates = 0  # trainer rank 0 numbers the updates; the number tags every notification
        self._news_for: dict[str, bytes] = {}  # trainer rank 0: each link's routes this update
        self._inbox: set[tuple[str, int, str]] = set()  # ("d" | "c", bucket, from agent): this update
        self._tag = ""  # the current update's
        self._writes: dict[Any, Any] = {}  # key -> (handle, peer, bucket, state) not yet waited on
        # this update's failures on the data path (each fails only what depends on it):
        self._aborted: dict[tuple[str, int], str] = {}  # (neighbour, tree) it told us it lost -> why
        self._cut: dict[str, str] = {}  # downstream neighbours no longer fed -> why
        self._dead: dict[int, str] = {}  # trees whose buckets no longer reach us -> why
        self._version = 0

    # --- lifecycle ---------------------------------------------------------------------
    @property
    def _mem(self) -> str:
        return "VRAM" if self.device.type == "cuda" else "DRAM"

    @property
    def _patience(self) -> float:
        """How long a data-path wait lasts before the neighbour is pinged (:class:`_Watch`):
        half the deadline, so a rank cut off from a dead upstream reports over its link
        before the trainers, whose agreement waits the whole deadline, give up on it."""
        return self.timeout / 2

    def prepare(self) -> dict[str, Any]:
        self._register()
        return self._store_metadata({"addr": comm.local_address(), "device": str(self.device),
                                     **self.buffer_metadata(), **self._greeting()})

    def _greeting(self) -> dict[str, Any]:
        return {"agent": self._agent_name, "nixl": self._agent.get_agent_metadata(),
                "slots": [self._desc(s) for s in self._slots], "topology": self.topology,
                "link_gbps": self.link_gbps, "replica": self.replica}

    def _open(self) -> None:
        if self._agent is None or not self._slots or self._slots[0].numel() < self.bucket_size:
            self._register()

    def _desc(self, t: torch.Tensor) -> tuple[int, int, int]:
        return (t.data_ptr(), t.numel(), t.device.index or 0)

    def _register(self) -> None:
        """A new agent, with the slots registered to it (``prepare()``: a new formation).
        Slots are sized from this rank's own bucket size (the group may agree on a smaller
        one: a slot larger than a bucket is fine) and kept while they are large enough.

        A new agent, not the old one with every peer removed: NIXL (1.5, UCX) keeps a
        connection's descriptors after ``remove_remote_agent``; dropping the agent frees
        them all. Between formations, connections change only where neighbours do."""
        keep = self._slots if self._slots and self._slots[0].numel() >= self.bucket_size else []
        self._drop_agent()
        nixl_agent, nixl_agent_config = self._api
        self._agent_name = f"wb-{os.getpid()}-{id(self):x}-{secrets.token_hex(4)}"
        self._agent = _new_agent(nixl_agent, nixl_agent_config, self._agent_name)
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
        replicas = replicas_of([m.get("replica") for m in metadata[T:]], [1] * R)
        common = {"trainer_world_size": T, "rollout_world_size": R, "master_addr": metadata[0]["addr"],
                  "master_port": metadata[0]["port"], "token": metadata[0]["token"],
                  "bucket_size": agree_buffers(T, metadata)}
        return link_topology(T, R, metadata, replicas, common)

    def link_replicas(self, add: list[tuple[str, int]], drop: list[str]) -> dict[str, str]:
        failed = super().link_replicas(add, drop)
        for link_id, _ in add:  # a replica on another topology is refused (it refuses us too)
            link = self._links.get(link_id)
            theirs = {p.get("topology", "auto") for p in link.peers} if link is not None else set()
            if theirs - {self.topology}:
                close(self._links.pop(link_id).pg, True)
                failed[link_id] = (f"{self.where()}: replica {link_id!r} asks for topology {sorted(theirs)}, "
                                   f"the trainers for {self.topology!r}: give every rank the same")
        return failed

    def _joined(self, prefix: str, k: int, trainer_metadata: list[dict[str, Any]]) -> None:
        theirs = {m.get("topology", "auto") for m in trainer_metadata}
        if theirs - {self.topology}:
            self._broken = "topology disagreement"
            raise PlanError(f"{self.where()}: the ranks disagree on topology: the trainers ask for "
                            f"{sorted(theirs)}, this rank for {self.topology!r}; give every rank the same")

    @property
    def connections(self) -> dict[str, int]:
        """The NIXL peers this rank is connected to: agent name -> the serial its connection
        was made under (a connection made again gets a new one)."""
        return dict(self._connected)

    def _drop_agent(self) -> None:
        """Writes in flight end, the agent goes (and every connection with it)."""
        if self._agent is not None:
            self._settle_writes()
            try:
                if self._reg is not None:
                    self._agent.deregister_memory(self._reg)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        self._agent, self._reg = None, None
        self._peers, self._connected, self._routes = {}, {}, {}

    def finalize(self, destroy_group: bool = False) -> None:
        if destroy_group:
            self._drop_all()
            self._drop_agent()
            self._slots, self._master, self._store_server = [], None, None
            self._forget_views()
        else:
            self._settle_writes()

    # --- routes: laid out by the trainers each update, told with the header --------------
    def _exchange_header(self, version: int, manifest: Any, error: str | None) -> Any:
        if self.role == "trainer":
            self._news_for = self._lay_out()
        return super()._exchange_header(version, manifest, error)

    def _lay_out(self) -> dict[str, bytes]:
        """Trainer side: this update's trees over the linked replicas' ranks, in the order
        they were linked (so a replica that joins or leaves moves only its neighbours);
        connects this rank to its heads. Returns each link's news."""
        T = self.T
        order: list[tuple[str, dict[str, Any], str]] = []  # (agent, greeting, who) per rollout position
        for link in self._live():
            order += [(p["agent"], p, f"replica {link.id!r} rank {j}") for j, p in enumerate(link.peers)]
        self._link_of = {p["agent"]: link for link in self._live() for p in link.peers}
        self._labels.update((name, who) for name, _, who in order)
        R = len(order)
        rates = [m.get("link_gbps") for m in self._trainer_metas]
        theirs = [p.get("link_gbps") for _, p, _ in order]
        fan = topology_mod.choose(T, max(R, 1), kind=self.topology,
                                  sender_gbps=None if None in rates else min(rates),
                                  receiver_gbps=None if None in theirs or not theirs else min(theirs))
        self.fanout = fan
        trainers = [(m["agent"], m, f"trainer rank {t}") for t, m in enumerate(self._trainer_metas)]
        heads, routes = self.routes([t[0] for t in trainers], [x[0] for x in order], fan)
        known = {name: (g["nixl"], g["slots"], who) for name, g, who in trainers + order}
        self._route({self.trainer_rank: (None, heads[self.trainer_rank])}, known)
        news: dict[str, bytes] = {}
        x = 0
        for link in self._live() if self.trainer_rank == 0 else ():  # rank 0 tells every link
            theirs_routes = routes[x:x + link.size]
            x += link.size
            near = {n for r in theirs_routes for up, down in r.values() for n in [up, *down] if n}
            news[link.id] = pickle.dumps({"fanout": (fan.sender, fan.relay), "routes": theirs_routes,
                                          "peers": {n: known[n] for n in sorted(near)}})
        return news

    @staticmethod
    def routes(trainers: list[str], rollouts: list[str], fan: topology_mod.Fanout,
               ) -> tuple[list[list[str]], list[dict[int, tuple[str, list[str]]]]]:
        """The trees of one update: each trainer's heads, and each rollout's (upstream,
        downstream) in every tree, by agent name; ``rollouts`` in their ring order."""
        R = len(rollouts)
        heads: list[list[str]] = []
        routes: list[dict[int, tuple[str, list[str]]]] = [{} for _ in range(R)]
        for c, trainer in enumerate(trainers):
            first, children = topology_mod.layout(c, R, fan) if R else ([], {})
            parent = topology_mod.parent_of(c, R, fan) if R else {}
            heads.append([rollouts[h] for h in first])
            for x in range(R):
                up = parent[x]
                routes[x][c] = (trainer if up is None else rollouts[up], [rollouts[y] for y in children[x]])
        return heads, routes

    def _news(self, link: Any) -> None:
        """Per update, on each link: the update's number, and (when they changed) the
        routes of the link's ranks with their neighbours' NIXL metadata."""
        word = torch.zeros(2, dtype=torch.int64)
        payload: bytes | None = None
        if link is not None:
            if self.trainer_rank == 0:
                if link is self._live()[0]:
                    self._updates += 1
                payload = self._news_for.get(link.id, b"")
                if payload == link.said:
                    payload = b""
                word[:] = torch.tensor([len(payload), self._updates])
            link.said = self._news_for.get(link.id, b"")
        self._ctl_wait(comm.broadcast(self._ctl, word, 0), "header routes")
        n, self._updates = word.tolist()
        if n:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else \
                torch.empty(n, dtype=torch.uint8)
            self._ctl_wait(comm.broadcast(self._ctl, data, 0), "header routes")
            if link is None:
                news = pickle.loads(bytes(data.numpy()))
                self.fanout = topology_mod.Fanout(*news["fanout"])
                self._route(news["routes"][self._replica_rank], news["peers"])

    def _route(self, routes: dict[int, tuple[str | None, list[str]]],
               known: dict[str, tuple[bytes, list, str]]) -> None:
        """Take ``routes`` (tree -> (upstream, downstream agents)): connect to neighbours
        that are new, drop the ones that are no longer neighbours; the others stay as they
        are. A neighbour that cannot be reached fails this update's data path."""
        self._routes = {int(c): (up, list(down)) for c, (up, down) in routes.items()}
        need = {n for up, down in self._routes.values() for n in [up, *down] if n}
        self._route_error = ""
        for name in [n for n in self._peers if n not in need]:
            self._disconnect(name)
        for name in sorted(need - set(self._peers)):
            agent_meta, slots, who = known[name]
            self._labels[name] = who
            try:
                self._agent.add_remote_agent(agent_meta)
            except Exception as e:  # noqa: BLE001 - e.g. UCX cannot reach it: it is gone
                self._route_error = self._route_error or \
                    f"cannot connect to {who}'s NIXL agent {name!r}: {e}"
                continue
            self._peers[name] = [tuple(s) for s in slots]
            self._connections += 1
            self._connected[name] = self._connections

    # --- the current update's tag and mailbox ----------------------------------------
    def _begin(self, version: int) -> None:
        self._settle_writes()  # what a failed update left in flight
        self._tag = f"{self._master[2] if self._master else ''}/{self._updates}"
        self._inbox.clear()
        self._version = version
        self._aborted, self._cut, self._dead, self._alive, self._gone = {}, {}, {}, {}, {}

    def _settle_writes(self) -> None:
        """Let writes in flight end (within our patience), without failing on them."""
        deadline = time.monotonic() + self._patience
        pause = comm.Pause()
        for key in list(self._writes):
            handle, _, _, state = self._writes.pop(key)
            while state == "PROC" and time.monotonic() < deadline:
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception:  # noqa: BLE001 - the peer is gone
                    break
                pause()
            self._release_handle(handle)

    def _poll(self) -> None:
        prefix = self._tag + "/"
        try:
            notes = self._agent.get_new_notifs()
        except Exception as e:  # noqa: BLE001
            raise TransferFailed(f"{self.where()}: reading NIXL notifications failed: {e}") from e
        for agent, msgs in notes.items():
            for m in msgs:
                kind, _, rest = m.decode(errors="replace").partition(":")
                if not rest.startswith(prefix):  # from an update that failed
                    continue
                if kind == "a":  # "a:<tag>/<tree>/<why>": nothing more comes from it in that tree
                    tree, _, why = rest[len(prefix):].partition("/")
                    self._aborted.setdefault((agent, int(tree)), why)
                elif kind == "g":  # "g:<tag>/<agent>/<why>": found gone; so it is for us, and we pass it on
                    name, _, why = rest[len(prefix):].partition("/")
                    self._heard_gone(name, agent, why)
                elif kind == "p":  # a neighbour waiting on us asks whether we live
                    self._say(agent, "k")
                elif kind == "k":
                    self._alive[agent] = time.monotonic()
                else:
                    self._inbox.add((kind, int(rest[len(prefix):]), agent))

    def _say(self, peer: str, kind: str) -> None:
        try:
            self._agent.send_notif(peer, f"{kind}:{self._tag}/0".encode())
        except Exception:  # noqa: BLE001 - it is gone: its waits end by their deadline
            pass

    def _tell_abort(self, peer: str, tree: int, why: str) -> None:
        try:
            self._agent.send_notif(peer, f"a:{self._tag}/{tree}/{why[:512]}".encode())
        except Exception:  # noqa: BLE001 - best effort: it may be the one gone
            pass

    def _tree_lost(self, tree: int, why: str) -> None:
        """Nothing more of tree ``tree`` reaches this rank in this update: its buckets fail
        here (each says why), and the ranks below us in it are told at once, so their waits
        end now with our reason, not at their deadline. Other trees go on: a rank that lost
        one tree still forwards the others, so a death costs only the ranks below it."""
        if tree in self._dead:
            return
        self._dead[tree] = why
        for child in self._routes.get(tree, (None, []))[1]:
            self._tell_abort(child, tree, f"{self.where()}: {why}")

    def _sever(self, peer: str, why: str) -> None:
        """``peer`` is gone or hangs: everything from it fails for this update, everything
        to it stops, and the connection is dropped, so a hung peer that wakes up cannot
        write a stale bucket into a slot that holds another one by then."""
        for c, (up, down) in self._routes.items():
            if up == peer:
                self._tree_lost(c, f"{self._who(peer)}: {why}")
            if peer in down:
                self._cut_off(peer, f"tree {c}", why, gone=False)
        self._found_gone(peer, why)
        if peer in self._peers:
            self._disconnect(peer)

    def _disconnect(self, peer: str) -> None:
        try:
            self._agent.remove_remote_agent(peer)
        except Exception:  # noqa: BLE001 - gone already
            pass
        del self._peers[peer]
        self._connected.pop(peer, None)

    def _found_gone(self, peer: str, why: str) -> None:
        """``peer`` is dead or hung: tell every neighbour (each passes it on once), so the
        other ranks that wait on it stop now instead of each after its own patience; a
        trainer drops that replica from the update at once (no agreement waits on it)."""
        if peer in self._gone:
            return
        self._gone[peer] = why
        note = f"g:{self._tag}/{peer}/{why[:400]}".encode()
        for name in self._peers:
            if name != peer:
                try:
                    self._agent.send_notif(name, note)
                except Exception:  # noqa: BLE001 - best effort
                    pass
        link = self._link_of.get(peer)
        if link is not None and link.lost is None:
            self._lose(link, "the data path", RuntimeError(f"{self._who(peer)}: {why}"))

    def _heard_gone(self, peer: str, teller: str, what: str) -> None:
        if peer in self._gone:
            return
        why = f"{self._who(teller)} found it dead or hung ({what})"
        if peer in self._peers:
            self._sever(peer, why)
        else:
            self._found_gone(peer, why)

    def _cut_off(self, peer: str, phase: str, why: str, gone: bool = True) -> None:
        """A downstream neighbour is gone (``gone``), or stopped taking buckets: this rank
        stops feeding it for the rest of the update and goes on (the neighbour's own subtree
        fails, each rank saying so over its own link); it is told, in case it lives."""
        if gone:
            self._found_gone(peer, f"{phase}: {why}")
        if peer in self._cut:
            return
        self._cut[peer] = f"{phase}: {why}"
        _log.warning("%s: %s failed (%s); not feeding %s for the rest of this update",
                     self.where(), phase, why, self._who(peer))
        for key in [k for k, w in self._writes.items() if w[1] == peer]:
            self._release_handle(self._writes.pop(key)[0])
        for c, (_, down) in self._routes.items():
            if peer in down:
                self._tell_abort(peer, c, f"{self.where()}: cut off: {phase}: {why}")

    def _await(self, kind: str, b: Bucket, peer: str, phase: str) -> bool:
        """Wait for bucket ``b``'s data (``d``, from our upstream in its tree) or its
        credit (``c``, from a downstream neighbour). False when it will not come: the tree
        is lost here (data), or that neighbour is cut off (credit)."""
        tree = b.owner
        watch = _Watch(self, peer)
        key = (kind, b.index, peer)
        pause = comm.Pause()
        while key not in self._inbox:
            if (tree in self._dead) if kind == "d" else (peer in self._cut):
                return False
            self._progress()
            self._poll()
            if key in self._inbox:
                break
            told = self._aborted.get((peer, tree))
            if told is not None:
                if kind == "d":
                    self._tree_lost(tree, f"{self._who(peer)} lost it: {told}")
                else:
                    self._cut_off(peer, phase, f"it failed: {told}", gone=False)
                return False
            late = watch.expired()
            if late is not None:
                what = "data" if kind == "d" else "credit"
                why = f"no {what} for bucket {b.index} from {self._who(peer)} {late}"
                if kind == "d":
                    self._sever(peer, why)
                else:
                    self._cut_off(peer, phase, why)
                return False
            pause()
        self._inbox.discard(key)
        return True

    def _progress(self) -> None:
        """Drive our writes in flight: UCX moves a write (and delivers its notification)
        only while its initiator asks for its state. Every write goes downstream: one that
        failed cuts its peer off."""
        for key, (handle, peer, b, state) in list(self._writes.items()):
            if key not in self._writes:
                continue  # its peer was cut off in this loop
            if state == "PROC":
                try:
                    state = self._agent.check_xfer_state(handle)
                except Exception as e:  # noqa: BLE001 - NIXL raises when the peer is gone
                    state = f"ERR ({type(e).__name__}: {e})"
                self._writes[key] = (handle, peer, b, state)
            if state not in ("PROC", "DONE"):
                self._writes.pop(key)
                self._release_handle(handle)
                self._cut_off(peer, f"write bucket {b} to {self._who(peer)}",
                              f"NIXL reports {state} (is it gone?)")

    def _who(self, agent: str | None) -> str:
        return self._labels.get(agent or "", f"NIXL agent {agent!r}")

    def _notify(self, peer: str, kind: str, b: int) -> None:
        try:
            self._agent.send_notif(peer, f"{kind}:{self._tag}/{b}".encode())
        except Exception as e:  # noqa: BLE001 - NIXL raises when the peer is gone
            self._sever(peer, f"credit for bucket {b} failed: {e}")

    def _write(self, key: Any, src: torch.Tensor, peer: str, b: Bucket) -> None:
        """Post a write of ``src`` into ``peer``'s slot for bucket ``b``; the notification
        that it landed travels with it. A write that cannot start cuts the peer off."""
        slots = self._peers[peer]
        addr, _, dev = slots[b.index % len(slots)]
        phase = f"write bucket {b.index} to {self._who(peer)}"
        try:
            mine = (src.data_ptr(), b.wire_bytes, src.device.index or 0)
            local = self._agent.get_xfer_descs([mine], self._mem)
            remote = self._agent.get_xfer_descs([(addr, b.wire_bytes, dev)], self._mem)
            note = f"d:{self._tag}/{b.index}".encode()
            handle = self._agent.initialize_xfer("WRITE", local, remote, peer, note)
        except Exception as e:  # noqa: BLE001 - NIXL raises when the peer is gone
            return self._cut_off(peer, phase, str(e))
        try:
            state = self._agent.transfer(handle)
        except Exception as e:  # noqa: BLE001
            self._release_handle(handle)
            return self._cut_off(peer, phase, str(e))
        if state == "ERR":
            self._release_handle(handle)
            return self._cut_off(peer, phase, "NIXL refused the transfer")
        self._writes[key] = (handle, peer, b.index, state)

    def _wait_writes(self, key: Any) -> None:
        """Until the writes whose keys start with ``key`` (None: every write) have landed,
        or their peers are cut off."""
        keys = list(self._writes) if key is None else [k for k in self._writes if k[:len(key)] == key]
        for k in keys:
            if k not in self._writes:
                continue
            peer = self._writes[k][1]
            watch = _Watch(self, peer)
            pause = comm.Pause()
            while k in self._writes and self._writes[k][3] == "PROC":
                self._progress()
                self._poll()  # (and answer pings meanwhile)
                if k in self._writes and self._writes[k][3] == "PROC":
                    late = watch.expired()
                    if late is not None:
                        self._cut_off(peer, f"write bucket {self._writes[k][2]} to {self._who(peer)}",
                                      f"still in flight {late}")
                        break
                    pause()
            if k in self._writes:
                self._release_handle(self._writes.pop(k)[0])

    def _release_handle(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - released with the agent anyway
            pass

    def _reduce_max(self, t: torch.Tensor, phase: str) -> None:
        # our writes move only while we drive them (_progress): they land before we block
        # on the control group, where the next round of a delta update is agreed
        self._wait_writes(None)
        super()._reduce_max(t, phase)

    # --- transport hooks ---------------------------------------------------------------
    def _packs(self, b: Bucket) -> bool:
        return b.owner == self.trainer_rank

    def _owners(self, plan: BucketPlan, index: int) -> frozenset[int]:
        return plan.owners_of(index)

    def _acquire(self, b: Bucket) -> torch.Tensor:
        if self._route_error:
            raise TransferFailed(f"{self.where()}: send bucket {b.index} failed: {self._route_error}")
        s = b.turn % self.num_buffers  # this trainer's own buckets, in turn
        self._wait_writes(("out", s))
        return self._slots[s]

    def _send(self, b: Bucket, slot: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # packed before NIXL reads it
        for head in self._routes[b.owner][1]:
            if self._await("c", b, head, f"send bucket {b.index} to {self._who(head)}: waiting "
                                               f"for a free slot"):
                self._write(("out", b.turn % self.num_buffers, head), slot, head, b)

    def _flush_send(self, plan: BucketPlan) -> None:
        self._wait_writes(None)

    def _post_recv(self, b: Bucket) -> None:
        if self._route_error:
            raise TransferFailed(f"{self.where()}: receive bucket {b.index} failed: {self._route_error}")
        if b.owner not in self._dead:  # slot b mod S is free here: its writer may go ahead
            self._notify(self._routes[b.owner][0], "c", b.index)  # type: ignore[arg-type]

    def _wait_recv(self, b: Bucket) -> torch.Tensor:
        up, down = self._routes[b.owner]
        slot = self._slots[b.index % self.num_buffers]
        if not self._await("d", b, up, f"receive bucket {b.index} from {self._who(up)}"):  # type: ignore[arg-type]
            # lost on the way (no write can land here any more): the bucket fails with why
            self._stamper.stamp(slot, b, self._version, buffers.STATUS_ABORT,
                                f"{self.where()}: bucket {b.index} never came: {self._dead[b.owner]}")
            return slot
        for nxt in down:  # pass it on while we unpack it
            if self._await("c", b, nxt, f"forward bucket {b.index} to {self._who(nxt)}"):
                self._write(("fwd", b.index, nxt), slot, nxt, b)
        return slot

    def _release(self, b: Bucket) -> None:
        self._wait_writes(("fwd", b.index))  # forwarded before the slot is offered again
        if self.device.type == "cuda":  # and unpacked: the copies out of it have run
            torch.cuda.current_stream(self.device).synchronize()

    def _flush_recv(self, plan: BucketPlan) -> None:
        self._wait_writes(None)


class _Watch:
    """One wait on one neighbour. After ``patience`` without what we wait for, the
    neighbour is pinged: one that answers lives (and is itself waiting on someone: a rank
    answers whenever it waits), and is waited for again, up to the whole deadline; one that
    does not answer within a grace period is dead or hung, and is given up on. So only the
    ranks next to a lost one give up on it, whatever the trees look like."""

    def __init__(self, engine: NixlEngine, peer: str):
        self.engine, self.peer = engine, peer
        self.start = time.monotonic()
        self.deadline = self.start + engine._patience
        self.probe: float | None = None

    def expired(self) -> str | None:
        """None while the wait goes on; else why it ends."""
        e, now = self.engine, time.monotonic()
        if self.probe is not None and e._alive.get(self.peer, -1.0) >= self.probe:
            self.probe = None  # it lives: wait on, but never past the engine's deadline
            self.deadline = min(now + e._patience, self.start + e.timeout)
        if now <= self.deadline:
            return None
        if self.probe is None and now < self.start + e.timeout:
            self.probe, self.deadline = now, now + min(e._patience / 2, 2.0)
            e._say(self.peer, "p")
            return None
        if self.probe is None:
            return f"within the deadline ({e.timeout:.0f}s), though it answers"
        return f"within {self.probe - self.start:.1f}s, and it did not answer a ping"
