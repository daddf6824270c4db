"""Replicas linked one by one: the control plane of the elastic engines (``mooncake``,
``nixl``).

Each rollout replica has a control group of its own with the trainer ranks, a *link*: the
T trainer ranks first, then the replica's k ranks, formed over trainer rank 0's store. The
core's header and final status run on each link, so

- a replica joins (:meth:`LinkedEngine.link_replicas` on the trainers, :meth:`attach` on
  its ranks) or leaves without touching any other replica's link;
- the trainers agree the outcome with every replica at once: one that never answers (it
  died, or hangs) is dropped from the update after the deadline and costs the others
  nothing; the trainer then raises :class:`~weightbus.errors.ReplicasFailed`;
- a link stays usable after an update that failed on its data path
  (:class:`~weightbus.errors.TransferFailed`): only links whose control group broke are
  formed again.

The data path is the engine's own (Mooncake reads, NIXL writes); this module is only the
bookkeeping of who is linked, and the per-link versions of the core's agreements.
"""

from __future__ import annotations

import contextlib
import pickle  # control words among our own ranks
import time
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from weightbus import comm
from weightbus.engines.api import UpdateStats, agree_buffers
from weightbus.engines.bucket import BucketEngine
from weightbus.errors import PlanError, ReplicasFailed, WeightSyncError, as_timedelta
from weightbus.plan import Manifest


class Link:
    """Trainer side: the control group of one replica (the T trainer ranks, then the
    replica's k ranks)."""

    def __init__(self, link_id: str, size: int, pg: Any, serial: int):
        self.id, self.size, self.pg, self.serial = link_id, size, pg, serial
        self.fp: int | None = None  # the manifest this replica has seen
        self.lost: str | None = None  # why it was lost during the current update
        self.peers: list[dict[str, Any]] = []  # what its ranks said of themselves when linked
        self.said: bytes = b""  # the engine's last per-update news to it
        self.words: dict[int, tuple[Any, torch.Tensor]] = {}  # engine's in-flight words
        self.sent: list[tuple[Any, torch.Tensor]] = []


class LinkedEngine(BucketEngine):
    """A bucket engine whose replicas are linked to the trainers one by one (see the module
    doc). Subclasses move the bytes; hooks: :meth:`_open` (local transport ready),
    :meth:`_greeting` (what a rollout rank tells the trainers when linked), :meth:`_joined`
    (a rollout rank's link is formed) and :meth:`_news` (per-update words on a link)."""

    #: replicas join and leave without re-forming the others (the manager links them one by one)
    elastic = True
    #: whether a rollout rank tells the trainers about itself when linked (:meth:`_greeting`)
    greets: ClassVar[bool] = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._master: tuple[str, int, str] | None = None  # trainer rank 0's store, and its token
        self._serial = 0  # control groups this engine has formed
        self.T = self.R = 1
        # trainer side
        self._links: dict[str, Link] = {}
        self._failed: dict[str, str] = {}  # replicas the last update lost or failed
        self._trainer_metas: list[dict[str, Any]] = []
        # rollout side
        self._link = ""
        self._link_serial = 0
        self._replica_rank = 0

    # --- hooks -------------------------------------------------------------------------
    def _open(self) -> None:
        """This rank's transport and registered slots, ready to be described."""

    def _greeting(self) -> dict[str, Any]:
        """What a rollout rank tells the trainers when it is linked (engines that set
        :attr:`greets`)."""
        return {}

    def _joined(self, prefix: str, k: int, trainer_metadata: list[dict[str, Any]]) -> None:
        """Rollout side: this rank's link is formed (``prefix`` names it in the store)."""

    def _news(self, link: Link | None) -> None:
        """After the header on one link (``None``: a rollout rank's own): per-update words."""

    # --- formation -----------------------------------------------------------------------
    def _connect(self, addr: str, port: int, token: str) -> None:
        if self._master != (addr, port, token):
            self._drop_all()
            self._store = comm.connect_store(addr, port, self.timeout, self.where())
            self._master = (addr, port, token)
        self._broken = None

    def init_process_group(self, *, rank: int, trainer_world_size: int, rollout_world_size: int,
                           master_addr: str, master_port: int, token: str,
                           links: list[tuple[str, int]] | None = None,
                           link: tuple[str, int, int] | None = None,
                           trainers: list[dict[str, Any]] | None = None,
                           bucket_size: int | None = None) -> None:
        """What :func:`link_topology` hands out, all replicas at once. Trainer ranks:
        ``links`` = (id, size) of every replica; rollout ranks: ``link`` = (id, rank in the
        replica, size) of their own; ``trainers``: every trainer rank's metadata."""
        T, R = trainer_world_size, rollout_world_size
        self._take_place(rank, T, R, bucket_size)
        self._open()
        self._connect(master_addr, master_port, token)
        if rank < T:
            self._trainer_metas = list(trainers or [])
            failed = self.link_replicas(list(links or []), list(self._links))
            if failed:
                raise WeightSyncError("; ".join(failed.values()))
        elif link is None:
            raise PlanError(f"{self.where()}: a rollout rank needs its link (id, rank in replica, size)")
        else:
            self._join(link, list(trainers or []))

    rebuild_group = init_process_group

    def serve(self, rank: int, trainer_metadata: list[dict[str, Any]]) -> None:
        """Trainer rank ``rank`` of ``len(trainer_metadata)`` (every trainer rank's
        ``prepare()``, in rank order) takes its place; replicas are linked afterwards."""
        T = len(trainer_metadata)
        self._take_place(rank, T, 0, agree_buffers(T, trainer_metadata))
        self._trainer_metas = list(trainer_metadata)
        m = trainer_metadata[0]
        self._connect(m["addr"], m["port"], m["token"])

    def link_replicas(self, add: list[tuple[str, int]], drop: list[str]) -> dict[str, str]:
        """Trainer side: forget the replicas ``drop`` (ids; unknown ones are ignored), then
        form a control group with each replica of ``add`` ((id, size); its ranks call
        :meth:`attach` at the same time). No other replica's group is touched, and a
        replica that does not come (it died) fails alone: returns {id: why} of those."""
        for link_id in drop:
            link = self._links.pop(link_id, None)
            if link is not None:
                close(link.pg, link.lost is not None)
        self._ctl_rank = self.trainer_rank  # in every link, the trainer ranks come first
        failed: dict[str, str] = {}
        for link_id, size in add:
            if link_id in self._links:
                raise PlanError(f"{self.where()}: replica link {link_id!r} exists already")
            where = f"{self.where()} linking replica {link_id!r}"
            pg = None
            try:
                pg = comm.new_group("gloo", self._store, f"wb/{self._master[2]}/{link_id}",  # type: ignore[index]
                                    self.trainer_rank, self.T + size, self.timeout, None, where)
                peers = [self._greeted(pg, self.T + j, None, where) for j in range(size)] \
                    if self.greets else [{}] * size
            except WeightSyncError as e:
                if pg is not None:
                    close(pg, True)
                failed[link_id] = str(e)
                continue
            self._serial += 1
            self._links[link_id] = Link(link_id, size, pg, self._serial)
            self._links[link_id].peers = peers
        self.R = sum(link.size for link in self._links.values())
        self.world_size = self.T + self.R
        return failed

    def _greeted(self, pg: Any, root: int, mine: dict[str, Any] | None, where: str) -> dict[str, Any]:
        """Link rank ``root``'s greeting (``mine`` there, None elsewhere), as every rank of
        the link hears it."""
        data = pickle.dumps(mine) if mine is not None else None
        try:
            return pickle.loads(bcast_bytes(pg, data, root))
        except Exception as e:  # noqa: BLE001
            raise WeightSyncError(f"{where}: greeting from link rank {root} failed: {e}") from e

    def attach(self, trainer_metadata: list[dict[str, Any]], link: str, rank: int, size: int) -> None:
        """Rollout side: rank ``rank`` of a replica of ``size`` ranks joins the trainers
        (which call :meth:`link_replicas` with ``(link, size)`` at the same time)."""
        T = len(trainer_metadata)
        # (this rank's say too: a joiner built with another num_buffers or delta is refused
        # here, naming both, not in its first update)
        self._take_place(T + rank, T, size, agree_buffers(T, [*trainer_metadata, self.buffer_metadata()]))
        self._open()
        m = trainer_metadata[0]
        self._connect(m["addr"], m["port"], m["token"])
        self._join((link, rank, size), trainer_metadata)

    def _join(self, link: tuple[str, int, int], trainer_metadata: list[dict[str, Any]]) -> None:
        self._drop_all()
        link_id, self._replica_rank, k = link
        prefix = f"wb/{self._master[2]}/{link_id}"  # type: ignore[index]
        where = f"{self.where()} joining as replica {link_id!r}"
        self._ctl = comm.new_group("gloo", self._store, prefix, self.T + self._replica_rank, self.T + k,
                                   self.timeout, None, where)
        self._ctl_rank = self.T + self._replica_rank
        for j in range(k if self.greets else 0):
            self._greeted(self._ctl, self.T + j, self._greeting() if j == self._replica_rank else None, where)
        self._joined(prefix, k, trainer_metadata)
        self._serial += 1
        self._link, self._link_serial = link_id, self._serial
        self._peers_fingerprint = None

    @property
    def links(self) -> dict[str, int]:
        """The control groups this rank holds, usable: replica link id -> the serial number
        it was formed under (a link formed again gets a new one)."""
        if self.role == "trainer":
            return {link.id: link.serial for link in self._links.values() if link.lost is None}
        return {self._link: self._link_serial} if self._ctl is not None and not self._broken else {}

    def _drop_all(self) -> None:
        for link in self._links.values():
            close(link.pg, link.lost is not None)
        self._links = {}
        if self._ctl is not None:
            close(self._ctl, bool(self._broken))
        self._ctl = None

    # --- trainer side: one replica lost does not fail the others -----------------------
    def _check_ready(self, role: Any) -> None:
        if role == self.role == "trainer" and not self._broken:  # its groups are the links
            self._prune()
            if not self._links:
                raise WeightSyncError(f"{self.where()}: no replica is linked; call init_process_group() "
                                      f"(or link_replicas()) first")
            return
        super()._check_ready(role)

    def _prune(self) -> None:
        """Forget the replicas an earlier update lost (the manager links them again if
        they come back)."""
        for link_id in [x.id for x in self._links.values() if x.lost]:
            del self._links[link_id]

    def _live(self) -> list[Link]:
        return [link for link in self._links.values() if link.lost is None]

    def _lose(self, link: Link, phase: str, e: BaseException) -> None:
        """Replica ``link`` failed this update; the others go on."""
        if link.lost is None:
            link.lost = f"{phase}: {e}"
            link.words.clear()
            link.sent.clear()
            close(link.pg, True)

    @contextlib.contextmanager
    def _on(self, link: Link, phase: str) -> Iterator[None]:
        """Run the core's header or finish on one replica's group: a transport failure
        there loses that replica only."""
        self._ctl, self._peers_fingerprint, self._broken = link.pg, link.fp, None
        try:
            yield
        finally:
            link.fp = self._peers_fingerprint
            if self._broken:
                self._lose(link, phase, RuntimeError(self._broken))
            self._ctl, self._broken = None, None

    def _exchange_header(self, version: int, manifest: Manifest | None, error: str | None,
                         ) -> tuple[int, Manifest]:
        if self.role != "trainer":
            agreed = super()._exchange_header(version, manifest, error)
            self._news(None)
            return agreed
        agreed: tuple[int, Manifest] | None = None
        aborted: WeightSyncError | None = None
        for link in self._live():
            try:
                with self._on(link, "header"):
                    agreed = super()._exchange_header(version, manifest, error)
                    self._news(link)
            except WeightSyncError as e:
                if link.lost is None:  # the sender root's abort, told to every replica
                    aborted = aborted or e
        if aborted is not None:
            raise aborted
        if agreed is None:
            raise WeightSyncError(f"{self.where()}: update to version {version} reached no replica: "
                                  + "; ".join(f"{x.id}: {x.lost}" for x in self._links.values()))
        return agreed

    def _finish(self, version: int, error: str | None) -> None:
        if self.role != "trainer":
            return super()._finish(version, error)
        # every replica's outcome at once: one that never answers costs the others nothing
        pending = {}
        for link in self._live():
            flags = self._outcome(error)
            try:
                pending[link.id] = (comm.allreduce_max(link.pg, flags), flags)
            except Exception as e:  # noqa: BLE001
                self._lose(link, "finish", e)
        deadline = time.monotonic() + self.timeout
        own: WeightSyncError | None = None
        self._failed = {}
        for link in self._live():
            work, flags = pending[link.id]
            try:
                work.wait(as_timedelta(max(0.1, deadline - time.monotonic())))
                with self._on(link, "finish"):
                    self._finish_agreed(version, error, flags)
            except WeightSyncError as e:
                if getattr(e, "rank", self.T) < self.T:  # a trainer rank failed: every replica hears it
                    own = own or e
                elif link.lost is None:
                    self._failed[link.id] = str(e)
            except Exception as e:  # noqa: BLE001 - this replica's group failed
                self._lose(link, "finish", e)
        self._failed.update({x.id: x.lost for x in self._links.values() if x.lost})  # type: ignore[misc]
        self._prune()
        if own is not None:
            raise own

    def _reduce_max(self, t: torch.Tensor, phase: str) -> None:
        """Delta mode's agreements over one group per replica: each link reduces (the
        trainers take part in every one), the trainers combine the links' results, and
        trainer rank 0 tells every link the combined one, so every replica decides alike."""
        if self.role != "trainer":
            self._ctl_wait(comm.allreduce_max(self._ctl, t), phase)
            self._ctl_wait(comm.broadcast(self._ctl, t, 0), phase)
            return
        mine = t.clone()
        for link in self._live():
            part = mine.clone()
            try:
                with self._on(link, phase):
                    self._ctl_wait(comm.allreduce_max(link.pg, part), phase)
            except WeightSyncError:
                continue  # that replica is lost (recorded); the others go on
            torch.maximum(t, part, out=t)
        for link in self._live():
            try:
                with self._on(link, phase):
                    self._ctl_wait(comm.broadcast(link.pg, t, 0), phase)
            except WeightSyncError:
                continue

    async def send_weights(self, weights: Any, *, version: int | None = None,
                           rollback: bool = False) -> UpdateStats:
        stats = await super().send_weights(weights, version=version, rollback=rollback)
        if self._failed:
            reached = [x for x in self._links if x not in self._failed]
            raise ReplicasFailed(f"{self.where()}: version {stats.version} reached {len(reached)} "
                                 f"replica(s) but failed on "
                                 + "; ".join(f"replica {k!r} ({v})" for k, v in self._failed.items()),
                                 dict(self._failed), stats)
        return stats


def close(pg: Any, failed: bool) -> None:
    """Drop a control group; one that failed is aborted first (its peers may be gone)."""
    if failed:
        try:
            pg.abort()
        except Exception:  # noqa: BLE001 - it failed already
            pass


def bcast_bytes(pg: Any, data: bytes | None, root: int) -> bytes:
    """``data`` from ``root`` to every rank of ``pg`` (others pass None): its length, then
    (when not empty) the bytes."""
    n = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
    comm.broadcast(pg, n, root).wait()
    if not n.item():
        return b""
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None else \
        torch.empty(int(n.item()), dtype=torch.uint8)
    comm.broadcast(pg, buf, root).wait()
    return bytes(buf.numpy())


def replicas_of(names: list[Any], sizes: list[int]) -> list[tuple[int, int]]:
    """(first rollout rank, size) of every replica. Rollout ranks that name their replica
    (``engine.replica``, which the manager sets) are grouped by name (a replica's ranks are
    consecutive); otherwise every ``size`` consecutive ranks form one."""
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


def link_topology(T: int, R: int, metadata: list[dict[str, Any]], replicas: list[tuple[int, int]],
                  common: dict[str, Any]) -> tuple[dict[str, list], dict[str, list]]:
    """``build_topology`` of a linked engine: every replica a link of its own; the trainer
    ranks get every link (id, size) and the trainers' metadata, each rollout rank its own
    (id, rank in the replica, size)."""
    links = [(f"r{j}", size) for j, (_, size) in enumerate(replicas)]
    mine = [(f"r{j}", r - first, size) for j, (first, size) in enumerate(replicas)
            for r in range(first, first + size)]
    trainers = metadata[:T]
    trainer = {key: [v] * T for key, v in common.items()} | {
        "rank": list(range(T)), "links": [links] * T, "link": [None] * T, "trainers": [trainers] * T}
    rollout = {key: [v] * R for key, v in common.items()} | {
        "rank": list(range(T, T + R)), "links": [[]] * R, "link": mine, "trainers": [trainers] * R}
    return trainer, rollout
