"""Layer 5: ``CheckpointEngineManager`` — one call per training step moves the trainer's
weights into every rollout replica.

Per update: pause generation on every replica -> (wake up, hybrid) -> form the group if
membership changed or the last update failed (every rank connects through a rendezvous
on the manager's TCPStore: prepare -> build_topology -> init_process_group) -> send /
receive -> resume. Groups are reused while membership is
unchanged. A replica that dies, hangs or fails makes ``update_weights`` raise within the
deadline, naming it; ``remove_replicas`` then lets the next update go to the others.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from weightbus import comm, config
from weightbus.engines.api import CheckpointEngineRegistry, CheckpointEngineWithCache
from weightbus.errors import ConfigError, UpdateFailed, WeightbusError, WeightSyncError
from weightbus.runtime.group import Pending, WorkerError, WorkerGroup


@dataclass
class UpdateReport:
    """What one update did: per-phase seconds, bytes per rollout rank, who got it."""

    version: int
    phases: dict[str, float] = field(default_factory=dict)
    bytes: int = 0
    replicas: list[str] = field(default_factory=list)
    rebuilt: bool = False
    #: elastic engines: the replicas linked to the trainers for this update (new, or
    #: back after a failure); every other replica kept its connections
    linked: list[str] = field(default_factory=list)
    #: delta mode (``delta=True``): True when the update went as changes, False when it went
    #: full (a replica held another version); None otherwise
    delta: bool | None = None
    #: bytes the trainer ranks put on their links, together
    wire_bytes: int = 0

    @property
    def seconds(self) -> float:
        return sum(self.phases.values())

    @property
    def transfer_gbps(self) -> float:
        t = self.phases.get("transfer", 0.0)
        return self.bytes / t / 1e9 if t > 0 else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """A plain dict, for a framework's metrics or logs."""
        return {**asdict(self), "seconds": self.seconds, "transfer_gbps": self.transfer_gbps}


class CheckpointEngineManager:
    """Drives weight updates from one trainer group to any number of rollout replicas.

    Args:
        backend: a registered engine name (``gloo``, ``nccl``, ``colocated``...).
        trainer: the trainer ranks (their class mixes in :class:`weightbus.worker.WeightbusWorker`).
        replicas: rollout replicas, each a worker group (its ranks are its TP ranks).
        timeout: deadline, seconds, of every phase; also the engines' own deadline.
        pause_mode: passed to ``pause_generation`` (``abort``, ``keep`` or ``wait``).
        hybrid: call ``wake_up`` on replicas before each update (pair it with
            :meth:`sleep_replicas` before training).
        registry: Ray only: the name of a registry that rollout replicas join by themselves
            (:func:`weightbus.runtime.ray.register_self` on each rank); every update then
            takes in the complete replicas registered there and drops those that left,
            and a registered replica that dies in an update is dropped (and unregistered).
        engine_kwargs: more constructor arguments for every engine (``bucket_size``...).
    """

    def __init__(self, backend: str, trainer: WorkerGroup, replicas: Sequence[WorkerGroup] = (), *,
                 timeout: float | None = None, pause_mode: str = "abort", hybrid: bool = False,
                 registry: str | None = None, **engine_kwargs: Any):
        self.engine_cls = CheckpointEngineRegistry.get(backend)  # unknown names fail here
        CheckpointEngineRegistry.check_options(backend, engine_kwargs)  # and misspelled options
        self.backend = backend
        self.trainer = trainer
        self.replicas: list[WorkerGroup] = []
        self.timeout = config.timeout(timeout)
        self.pause_mode = pause_mode
        self.hybrid = hybrid
        self.engine_kwargs = {"timeout": self.timeout, **engine_kwargs}
        self.version = 0
        self._setup: set[int] = set()  # ids of groups whose workers have an engine
        self._formed_for: tuple[int, ...] | None = None  # membership the group was formed for
        self._store: Any = None  # the rendezvous store every rank connects through
        self._formations = 0
        self._lost: list[tuple[WorkerGroup, str]] = []  # groups the last failed wait lost
        self._errored: list[WorkerGroup] = []  # groups that failed the last failed wait
        # elastic engines (``mooncake``): each replica is linked to the trainers on its own
        self._served: list[dict[str, Any]] | None = None  # the trainer ranks' metadata
        self._linked: dict[str, str] = {}  # replica name -> its link id
        self._stale: set[str] = set()  # link ids the trainers must drop
        self.registry = registry
        self._registered: set[str] = set()  # names of the replicas that came from the registry
        #: joined from a peer (delta mode): the chain it holds (version, digest, sharded plan)
        self._chains: dict[str, tuple[int, int, int | None]] = {}
        #: what the replicas serve in fp8 (weightbus.quant), as the trainers were told it
        self._formats: dict[str, Any] | None = None
        self.add_replicas(replicas)

    # --- membership ---------------------------------------------------------------------
    def add_replicas(self, replicas: Iterable[WorkerGroup]) -> None:
        """They receive the next update (the full weights)."""
        for r in replicas:
            if any(r is x for x in self.replicas):
                raise WeightbusError(f"replica {r.name!r} is already a member")
            if any(r.name == x.name for x in self.replicas):
                raise WeightbusError(f"another replica is already named {r.name!r} (members: "
                                     f"{[x.name for x in self.replicas]}); give each replica its "
                                     f"own name= so errors, versions() and remove_replicas can tell "
                                     f"them apart")
            self.replicas.append(r)

    # --- fully-async on a cache engine (``shm``, ``disk``) -----------------------------------
    def publish(self, version: int | None = None) -> dict[str, Any]:
        """The trainer publishes a version into the cache and returns: no replica is paused
        or waited for (each takes it with :meth:`pull`, when it is ready)."""
        self._need_cache("publish")
        version = self.version + 1 if version is None else config.version(version)
        if self._formed_for != tuple(id(r) for r in self.replicas):
            self._form(version)
        got = self._wait([(self.trainer, self.trainer.submit("wb_send", [(version,)] * self.trainer.size))],
                         f"publish of version {version}", self.timeout)
        self.version = version
        return got[0][0]

    def pull(self, replicas: Iterable[WorkerGroup | str] | None = None) -> dict[str, int | None]:
        """The given replicas (default: all) take the newest published version now, each
        paused only while it loads (a replica already on it does nothing); the others
        go on generating. Returns the version each of them holds."""
        self._need_cache("pull")
        chosen = self.replicas if replicas is None else [
            next(x for x in self.replicas if x is r or x.name == r) for r in replicas]
        if self._formed_for != tuple(id(r) for r in self.replicas):
            self._form(self.version)
        pending = [(r, r.submit("wb_pull", [(self.pause_mode,)] * r.size)) for r in chosen]
        got = self._wait(pending, "pull from the cache", self.timeout)
        return {r.name: (None if None in v or len(set(v)) != 1 else v[0])
                for r, v in zip(chosen, got, strict=True)}

    def _need_cache(self, what: str) -> None:
        if not issubclass(self.engine_cls, CheckpointEngineWithCache):
            raise WeightbusError(f"{what}() needs a cache backend ('shm' or 'disk'), not {self.backend!r}; "
                                 f"update_weights() is the synchronized update")

    def join_from_peer(self, replica: WorkerGroup, peer: WorkerGroup | str | None = None, *,
                       backend: str = "gloo") -> dict[str, Any]:
        """Add ``replica`` holding the current version, copied from a member that holds it
        (``peer``, or the first that does, with as many ranks) instead of from the trainer:
        each rank of the peer sends its own weights (its TP shard) to the joiner's rank of
        the same index, over a group of those two (``backend``: ``gloo``, or ``nccl``
        between GPUs), while the peer keeps generating (it is not
        paused) and the trainer is not involved (it may be training). The next update
        includes the joiner like any member (an elastic engine links just the joiner).
        Returns what moved."""
        CheckpointEngineRegistry.get(backend)  # an unknown name fails here
        if self.version == 0:
            raise WeightbusError("no version has been sent yet: a joiner gets the first one from the trainer")
        held = self.versions()
        candidates = [r for r in self.replicas if held.get(r.name) == self.version and
                      r.size == replica.size and (peer is None or r is peer or r.name == peer)]
        if not candidates:
            which = "" if peer is None else f" {getattr(peer, 'name', peer)!r}"
            raise WeightbusError(f"no member replica{which} of {replica.size} rank(s) holds version "
                                 f"{self.version} to give {replica.name!r}; versions held: {held}")
        src = candidates[0]
        self.add_replicas([replica])  # checks the name; undone below if the copy fails
        if self._store is None:
            self._store = comm.serve_store(self.timeout)
        self._formations += 1
        addr, port, prefix = comm.local_address(), self._store.port, f"wb-peer/{self._formations}"
        pairs = [(addr, port, f"{prefix}/{i}", self.timeout, backend) for i in range(replica.size)]
        try:
            sent = src.submit("wb_peer_send", pairs)
            got = replica.submit("wb_peer_receive", pairs)
            results = self._wait([(src, sent), (replica, got)],
                                 f"join of {replica.name!r} from {src.name!r}", self.timeout * 1.5)
        except BaseException:
            self.replicas.remove(replica)
            raise
        chains = {x.get("chain") and tuple(x["chain"]) for x in results[0]}
        if len(chains) == 1 and None not in chains:  # delta mode: the joiner holds the peer's chain
            self._chains[replica.name] = chains.pop()
        return {"peer": src.name, "version": self.version, "bytes": sum(x["bytes"] for x in results[0]),
                "seconds": max(x["seconds"] for x in results[0])}

    def _sync_registry(self) -> None:
        """Registry mode: take in the replicas that registered, drop those that left."""
        if self.registry is None:
            return
        from weightbus.runtime.ray import RayWorkerGroup, registered
        current = registered(self.registry, self.timeout)
        gone = [n for n in self._registered if n not in current]
        self.remove_replicas([r for r in self.replicas if r.name in gone])
        self._registered.difference_update(gone)
        names = {r.name for r in self.replicas}
        fresh = [RayWorkerGroup.from_actors(actors, name) for name, actors in current.items()
                 if name not in names]
        self.add_replicas(fresh)
        self._registered.update(g.name for g in fresh)

    def _forget_dead(self, dead: Sequence[WorkerGroup]) -> None:
        """Registry mode: a registered replica that died leaves (and is unregistered)."""
        if self.registry is None:
            return
        from weightbus.runtime.ray import unregister_self
        for r in dead:
            if r.name in self._registered:
                unregister_self(r.name, self.registry, self.timeout)
                self.remove_replicas([r])
                self._registered.discard(r.name)

    def remove_replicas(self, replicas: Iterable[WorkerGroup | str]) -> None:
        """They get no further update; their processes may already be gone."""
        for r in replicas:
            match = [x for x in self.replicas if x is r] or \
                [x for x in self.replicas if isinstance(r, str) and x.name == r]
            if len(match) != 1:
                raise WeightbusError(f"{'no' if not match else 'more than one'} replica "
                                     f"{getattr(r, 'name', r)!r} among {[x.name for x in self.replicas]}")
            self.replicas.remove(match[0])
            self._setup.discard(id(match[0]))

    def versions(self) -> dict[str, int | None]:
        """The version each replica fully holds (None: none, or its last update failed
        after it began writing). Asked of every replica at once, under one deadline."""
        return self._versions(self.replicas)

    def _versions(self, replicas: Sequence[WorkerGroup]) -> dict[str, int | None]:
        pending = [(rep, rep.submit("wb_version")) for rep in replicas]
        deadline = time.monotonic() + self.timeout
        out: dict[str, int | None] = {}
        for rep, p in pending:
            try:
                got = p.result(max(0.1, deadline - time.monotonic()))
                out[rep.name] = None if any(v is None for v in got) or len(set(got)) != 1 else got[0]
            except WorkerError:
                out[rep.name] = None
        return out

    def _try_all(self, groups: Sequence[WorkerGroup], method: str) -> dict[str, str | None]:
        """Call ``method`` on every group at once, under one deadline; never raises:
        returns each group's error (None: it succeeded)."""
        pending = [(g, g.submit(method)) for g in groups]
        deadline = time.monotonic() + self.timeout
        out: dict[str, str | None] = {}
        for g, p in pending:
            try:
                p.result(max(0.1, deadline - time.monotonic()))
                out[g.name] = None
            except WorkerError as e:
                out[g.name] = str(e).splitlines()[0][:200]
        return out

    # --- the update -----------------------------------------------------------------------
    def update_weights(self, version: int | None = None, *, rollback: bool = False) -> UpdateReport:
        """Pause every replica, move the weights, resume. On failure every replica that is
        still alive is resumed (on the weights it holds) before this raises
        :class:`UpdateFailed`, which names the cause and says which replica holds which
        version (None: none, or a torn one). A version lower than the last one is refused
        here, before anything starts, unless ``rollback`` says it is meant."""
        self._sync_registry()
        if not self.replicas:
            raise WeightbusError("no rollout replica to update"
                                 + (f" (none is registered in {self.registry!r})" if self.registry else ""))
        version = self.version + 1 if version is None else config.version(version)
        if version < self.version and not rollback:
            raise ConfigError(f"version {version} is lower than version {self.version}, the last update: "
                              f"update_weights({version}, rollback=True) if an older version is meant")
        report = UpdateReport(version, replicas=[r.name for r in self.replicas])
        clock = time.perf_counter()

        def phase(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            report.phases[name] = now - clock
            clock = now

        try:
            self._all(self.replicas, "pause_generation", version, kwargs={"mode": self.pause_mode})
            if self.hybrid:
                self._all(self.replicas, "wake_up", version)
            phase("pause")
            membership = tuple(id(r) for r in self.replicas)
            if membership != self._formed_for:
                linked = self._form(version)
                if linked is None:
                    report.rebuilt = True
                else:
                    report.linked = linked
            phase("setup")
            # (rollback travels only when meant: a worker's own wb_send(version) keeps working)
            sends = self.trainer.submit("wb_send", [(version, True) if rollback else (version,)]
                                        * self.trainer.size)
            recvs = [r.submit("wb_receive", [(version,)] * r.size) for r in self.replicas]
            # (elastic engines: a replica that dies in an update costs the trainers one whole
            # deadline when they agree the outcome with it, after the data path's own waits)
            slack = 2.0 if getattr(self.engine_cls, "elastic", False) else 1.5
            results = self._wait([(self.trainer, sends), *zip(self.replicas, recvs, strict=True)],
                                 f"update to version {version}", self.timeout * slack)
            phase("transfer")
        except WeightSyncError as e:
            self._formed_for = None  # the next update re-forms the group (elastic: links the failed)
            self._relink(self._errored)
            # a replica that died or hangs answers nothing (a hung one would keep the next
            # calls waiting behind it): the others are resumed, and asked what they hold
            lost = {id(g): why for g, why in self._lost}
            alive = [r for r in self.replicas if id(r) not in lost]
            resumed = self._try_all(alive, "resume_generation")
            resumed.update({r.name: lost[id(r)] for r in self.replicas if id(r) in lost})
            held = self._versions(alive) | {r.name: None for r in self.replicas if id(r) in lost}
            self._forget_dead([r for r in self.replicas if lost.get(id(r)) == "died"])
            ok = [n for n, err in resumed.items() if err is None]
            raise UpdateFailed(f"{e}. Resumed: {', '.join(ok) or 'none'}"
                               + "".join(f"; {n} not resumed ({err})" for n, err in resumed.items() if err)
                               + f". Versions held: {held}", held, ok) from e
        report.bytes = results[0][0]["bytes"]  # the payload every rollout rank received
        report.wire_bytes = sum(r.get("wire_bytes", 0) for r in results[0])
        full = results[0][0].get("full")
        report.delta = None if full is None else not full
        lost = {lid for r in results[0] for lid in r.get("failed", ())}
        if lost:  # a trainer dropped a link its replica thinks it holds: link it again
            self._relink([r for r in self.replicas if self._linked.get(r.name) in lost])
            self._formed_for = None
        self.version = version
        resumed = self._try_all(self.replicas, "resume_generation")
        failed = {n: err for n, err in resumed.items() if err}
        if failed:  # delivered everywhere, but a replica does not generate again
            self._formed_for = None
            raise UpdateFailed(f"version {version} reached every replica, but resume_generation failed on "
                               + "; ".join(f"replica {n!r} ({err})" for n, err in failed.items())
                               + f". Versions held: {self.versions()}", self.versions(),
                               [n for n in resumed if n not in failed])
        phase("resume")
        return report

    def sleep_replicas(self) -> None:
        """Hybrid: release rollout memory before training."""
        self._all(self.replicas, "sleep", self.version)

    def _form(self, version: int) -> list[str] | None:
        """Bring the group up to the current membership. Returns the replicas newly
        linked (elastic engines, which re-form nothing else), or None after a whole
        re-formation."""
        self._formed_for = None
        self._setup_engines(version)
        if getattr(self.engine_cls, "elastic", False):
            return self._link(version)
        if self._store is None:
            self._store = comm.serve_store(self.timeout)
        self._formations += 1
        where = (comm.local_address(), self._store.port, f"wb-manager/{self._formations}")
        T = self.trainer.size
        R = sum(r.size for r in self.replicas)
        pending, first = [], 0
        for g in [self.trainer, *self.replicas]:
            pending.append((g, g.submit("wb_connect", [(*where, first + i, T, R) for i in range(g.size)])))
            first += g.size
        self._wait(pending, "forming the weight-sync group", self.timeout)
        self._formed_for = tuple(id(r) for r in self.replicas)
        return None

    def _setup_engines(self, version: int) -> None:
        """An engine on every rank of a group that has none yet."""
        fresh = [g for g in [self.trainer, *self.replicas] if id(g) not in self._setup]

        def setup(g: Any) -> tuple[Any, ...]:  # a replica's ranks share its name
            trainer = g is self.trainer
            return (self.backend, "trainer" if trainer else "rollout", self.engine_kwargs,
                    None if trainer else f"replica-{id(g):x}")
        self._wait([(g, g.submit("wb_setup", [setup(g)] * g.size)) for g in fresh],
                   f"setting up engines for version {version}", self.timeout)
        self._agree_formats(fresh, version)
        self._setup.update(id(g) for g in fresh)
        adopt = [(g, self._chains.pop(g.name)) for g in fresh if g.name in self._chains]
        if adopt:  # joined from a peer in delta mode: it may take the next delta like the peer
            self._wait([(g, g.submit("wb_adopt", [chain] * g.size)) for g, chain in adopt],
                       f"setting up engines for version {version}", self.timeout)

    def _agree_formats(self, fresh: list[WorkerGroup], version: int) -> None:
        """Every replica must serve the same weights in fp8 (``wb_formats``: read off each
        rank's model); the trainers are told, and quantize those on the way. A replica
        that differs fails this update, naming it (it is asked again at the next)."""
        if not any(id(r) in self._setup for r in self.replicas):
            self._formats = None  # (no replica is left from before: the new ones decide)
        told = self._formats
        new = [g for g in fresh if g is not self.trainer]
        said = self._wait([(g, g.submit("wb_formats")) for g in new],
                          f"asking the replicas what they serve in fp8 for version {version}", self.timeout)
        for g, ranks in zip(new, said, strict=True):
            for formats in ranks:
                if self._formats is None:
                    self._formats = dict(formats)
                elif formats != self._formats:
                    theirs, ours = set(formats), set(self._formats)
                    diff = sorted((theirs ^ ours) or {n for n in theirs if formats[n] != self._formats[n]})
                    raise WeightSyncError(f"replica {g.name!r} serves {len(formats)} weight(s) in fp8, the "
                                          f"others {len(self._formats)} (first difference: {diff[0]!r}): "
                                          f"every replica must serve the same weights in the same formats")
        if self._formats is not None and (self._formats != told or any(g is self.trainer for g in fresh)):
            T = self.trainer.size
            self._wait([(self.trainer, self.trainer.submit("wb_set_formats", [(self._formats,)] * T))],
                       f"telling the trainer what the replicas serve in fp8 for version {version}",
                       self.timeout)

    def _link(self, version: int) -> list[str] | None:
        """Elastic engines: drop the links of replicas that left or failed, link the new
        ones (each joins the trainers in a control group of its own); the others keep
        theirs. The first time (or after the trainer failed), every replica is linked."""
        T = self.trainer.size
        whole = self._served is None
        if whole:
            metas = self._wait([(self.trainer, self.trainer.submit("wb_prepare"))],
                               f"preparing the trainer for version {version}", self.timeout)[0]
            self._wait([(self.trainer, self.trainer.submit("wb_serve", [(i, metas) for i in range(T)]))],
                       f"serving the replicas for version {version}", self.timeout)
            self._served, self._linked, self._stale = metas, {}, set()
        names = {r.name for r in self.replicas}
        drop = sorted(self._stale | {lid for n, lid in self._linked.items() if n not in names})
        self._linked = {n: lid for n, lid in self._linked.items() if n in names}
        new = [r for r in self.replicas if r.name not in self._linked]
        self._formations += 1
        add = [(f"{r.name}@{self._formations}", r.size) for r in new]
        self._stale.update(lid for lid, _ in add)  # until they are linked on every side
        pending = [(self.trainer, self.trainer.submit("wb_link", [(add, drop)] * T))]
        pending += [(r, r.submit("wb_attach", [(self._served, lid, i, r.size) for i in range(r.size)]))
                    for r, (lid, _) in zip(new, add, strict=True)]
        # (1.5x: a replica that never comes costs the trainers one formation deadline, and
        # must not make them look hung: that would re-link every replica)
        got = self._wait(pending, f"linking {[r.name for r in new] or 'no'} replica(s) for version {version}",
                         self.timeout * 1.5)
        self._stale.difference_update(drop)
        missed = {lid: why for rank in got[0] for lid, why in (rank or {}).items()}
        ok = [(r, lid) for r, (lid, _) in zip(new, add, strict=True) if lid not in missed]
        self._stale.difference_update(lid for _, lid in ok)
        self._linked.update({r.name: lid for r, lid in ok})
        if missed:
            names = [r.name for r, (lid, _) in zip(new, add, strict=True) if lid in missed]
            self._errored = [r for r in new if r.name in names]
            raise WeightSyncError(f"linking replica(s) {names} for version {version} failed: "
                                  + "; ".join(sorted(set(missed.values())))[:2000])
        self._formed_for = tuple(id(r) for r in self.replicas)
        return None if whole else [r.name for r in new]

    def _relink(self, groups: Sequence[WorkerGroup]) -> None:
        """Elastic engines: these groups failed an update. A replica whose link is still
        whole on both sides (the failure was on the data path, and the outcome was agreed
        over the link) keeps it; the others are linked again at the next update, and every
        replica is when the trainer died, hangs or cannot say what it holds."""
        if not getattr(self.engine_cls, "elastic", False) or self._served is None:
            return
        lost = {id(g) for g, _ in self._lost}
        if id(self.trainer) in lost:
            self._served = None
            return
        suspects = [g for g in groups if g is not self.trainer]
        held = self._links_held([self.trainer, *[g for g in suspects if id(g) not in lost]])
        if held.get(id(self.trainer)) is None:
            self._served = None
            return
        on_trainer = set.intersection(*map(set, held[id(self.trainer)]))  # type: ignore[arg-type]
        for g in suspects:
            lid = self._linked.get(g.name)
            ranks = held.get(id(g))
            if lid is not None and lid in on_trainer and ranks is not None and all(lid in r for r in ranks):
                continue
            self._linked.pop(g.name, None)
            if lid is not None:
                self._stale.add(lid)

    def _links_held(self, groups: Sequence[WorkerGroup]) -> dict[int, list[dict[str, int]] | None]:
        """Each group's ranks' usable links (None: it did not answer within a short wait)."""
        pending = [(g, g.submit("wb_links")) for g in groups]
        deadline = time.monotonic() + min(self.timeout, 10.0)
        out: dict[int, list[dict[str, int]] | None] = {}
        for g, p in pending:
            try:
                out[id(g)] = p.result(max(0.1, deadline - time.monotonic()))
            except WorkerError:
                out[id(g)] = None
        return out

    def _all(self, groups: Sequence[WorkerGroup], method: str, version: int,
             kwargs: dict[str, Any] | None = None) -> None:
        self._wait([(g, g.submit(method, None, [kwargs or {}] * g.size)) for g in groups],
                   f"{method} (version {version})", self.timeout)

    def _wait(self, pending: Sequence[tuple[WorkerGroup, Pending]], what: str, timeout: float) -> list[Any]:
        """Collect every group's results under one deadline; on failure name the groups
        that died or hung first (the others' errors are usually their consequence)."""
        deadline = time.monotonic() + timeout
        results, errors = [], []
        self._lost, self._errored = [], []
        for group, p in pending:
            try:
                results.append(p.result(max(0.1, deadline - time.monotonic())))
            except WorkerError as e:
                errors.append((group, e))
                results.append(None)
        if errors:
            self._formed_for = None  # the next update re-forms the group
            self._errored = [g for g, _ in errors]
            lost = [(g, e) for g, e in errors if {"died", "timed out"} & set(e.kinds.values())]
            self._lost = [(g, "died" if "died" in e.kinds.values() else "hung") for g, e in lost]
            first = lost or errors
            names = ", ".join(self._label(g) for g, _ in first)
            detail = " | ".join(str(e) for _, e in first + [x for x in errors if x not in first])
            raise WeightSyncError(f"{what} failed; cause: {names}: {detail}")
        return results

    def _label(self, group: WorkerGroup) -> str:
        return "the trainer" if group is self.trainer else f"replica {group.name!r}"

    def shutdown(self) -> None:
        """Tear down the engines (not the worker processes, which belong to the caller)."""
        self._store = self._served = None
        for g in [self.trainer, *self.replicas]:
            try:
                g.submit("wb_teardown").result(self.timeout)
            except WorkerError:
                pass
