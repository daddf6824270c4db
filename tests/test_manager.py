"""CheckpointEngineManager over local processes: the three training modes, elastic
membership, and replicas that die or hang mid-update (over Ray: test_manager_ray.py)."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import modes  # noqa: E402
from mgr_workers import ELASTIC, FailingRollout  # noqa: E402
from rl_workers import Rollout, Trainer  # noqa: E402

from weightbus import WeightbusError, WeightSyncError  # noqa: E402
from weightbus.comm import free_port  # noqa: E402
from weightbus.errors import UpdateFailed  # noqa: E402
from weightbus.manager import CheckpointEngineManager  # noqa: E402
from weightbus.runtime.group import LocalWorkerGroup, call  # noqa: E402


def test_hybrid_mode_local():
    rows = modes.hybrid(steps=2)
    assert [r["versions"] for r in rows] == [{"replica0": 1, "replica1": 1}, {"replica0": 2, "replica1": 2}]
    assert all(r["freed_bytes_while_training"] == [0, 0] for r in rows)  # memory released


def test_one_step_off_mode_local():
    rows = modes.one_step_off(steps=2)
    # generation (one step behind) ran while the trainer trained: both took about one step
    assert all(r["train_and_generate_s"] < r["generation_s"] + 0.5 + 0.4 for r in rows)


def test_fully_async_mode_local():
    out = modes.fully_async(steps=2)
    assert out["samples"] > 0 and out["versions"][-1] >= 1


def test_fully_async_on_the_cache_local():
    """The trainer publishes and returns; the slow replica lags a version after odd steps
    and catches up after even ones; samples name the version that made them."""
    out = modes.fully_async_cache(steps=3)
    assert out["samples"] > 0 and out["versions"][-1] >= 2
    assert out["lag"] == [{"replica0": 1, "replica1": 0}, {"replica0": 2, "replica1": 2},
                          {"replica0": 3, "replica1": 2}]
    assert max(out["blocked_s"]) < 2.0


@pytest.mark.parametrize("backend", ["gloo", *ELASTIC])
def test_elastic_add_remove_and_failures_local(backend):
    """Replicas join, leave, die and hang between and during updates. A broadcast engine
    re-forms its group on each change; an elastic one (mooncake, nixl) links only the
    replica that changed and keeps every other replica's link (checked on both sides), also
    after an update that failed on their data path; when one replica dies or hangs in an
    update, mooncake completes it on the others, nixl on the ranks above it in its chains."""
    elastic = backend in ELASTIC
    trainer = LocalWorkerGroup(Trainer, 2, free_port(), name="trainer")
    r0 = LocalWorkerGroup(Rollout, 1, name="r0")
    r1 = LocalWorkerGroup(Rollout, 2, name="r1")  # a replica of two ranks
    groups = [trainer, r0, r1]
    mgr = CheckpointEngineManager(backend, trainer, [r0, r1], timeout=8, bucket_size=1 << 16)

    def same(rep):
        want = call(trainer, "weights_digest", timeout=10)[0]
        return call(rep, "weights_digest", timeout=10) == [want] * rep.size

    def links(*reps):
        """Every control group held by the trainer ranks and these replicas' ranks."""
        return [call(g, "wb_links", timeout=10) for g in (trainer, *reps)]

    def kept(before, reps):
        """The replicas' own links, and the trainers' links to them, are the same objects."""
        now = links(*reps)
        for rank_links in now[0]:  # the trainer still holds each replica's link as it was
            for lid, serial in before[0][0].items():
                if any(lid in r for rep in before[1:] for r in rep):
                    assert rank_links.get(lid) == serial, (lid, rank_links)
        assert now[1:] == before[1:]

    try:
        first = mgr.update_weights(version=1)
        assert first.rebuilt and same(r0) and same(r1)
        call(trainer, "train_step", 2, timeout=10)
        again = mgr.update_weights(version=2)
        assert not again.rebuilt and again.linked == []  # nothing re-formed while membership holds
        assert mgr.versions() == {"r0": 2, "r1": 2}
        if elastic:
            held = links(r0, r1)
            assert all(len(x) == 2 for x in held[0]) and all(len(x) == 1 for rep in held[1:] for x in rep)

        late = LocalWorkerGroup(Rollout, 1, name="late")  # joins: gets the full current weights
        groups.append(late)
        mgr.add_replicas([late])
        call(trainer, "train_step", 3, timeout=10)
        rep = mgr.update_weights(version=3)
        assert same(late) and same(r0) and mgr.versions()["late"] == 3
        if elastic:
            assert not rep.rebuilt and rep.linked == ["late"]
            kept(held, [r0, r1])
        else:
            assert rep.rebuilt
        with pytest.raises(WeightbusError, match="already a member"):
            mgr.add_replicas([late])

        if elastic:
            held = links(r0, late)
        mgr.remove_replicas([r1])
        r1.shutdown()  # its processes are gone; the next update does not need them
        call(trainer, "train_step", 4, timeout=10)
        rep = mgr.update_weights(version=4)
        assert mgr.versions() == {"r0": 4, "late": 4}
        if elastic:
            assert not rep.rebuilt and rep.linked == []
            kept(held, [r0, late])
            assert all(len(x) == 2 for x in links()[0])  # the trainers dropped r1's link

        if elastic:  # a newcomer that dies while it is linked: it fails alone, the others keep theirs
            from mgr_workers import AttachDies
            held = links(r0, late)
            ghost = LocalWorkerGroup(AttachDies, 1, name="ghost")
            groups.append(ghost)
            mgr.add_replicas([ghost])
            with pytest.raises(WeightSyncError, match="replica 'ghost'"):
                mgr.update_weights(version=5)
            mgr.remove_replicas([ghost])
            rep = mgr.update_weights(version=5)
            assert not rep.rebuilt and rep.linked == [] and same(r0) and same(late)
            kept(held, [r0, late])

        for mode in ("die", "hang"):
            bad = LocalWorkerGroup(FailingRollout, 1, mode, 5 if mode == "die" else 6, name=f"bad-{mode}")
            groups.append(bad)
            mgr.add_replicas([bad])
            version = 5 if mode == "die" else 6
            call(trainer, "train_step", version, timeout=10)
            if elastic:
                held = links(r0, late)
            t0 = time.monotonic()
            with pytest.raises(WeightSyncError, match=f"replica 'bad-{mode}'") as failed:
                mgr.update_weights(version=version)
            assert time.monotonic() - t0 < 8 * (2 if elastic else 1.5) + 8 + 5  # deadlines, not a hang
            if backend == "nixl":  # chains: the ranks above it complete, the ones below fail in time
                # (trees r0 -> late -> bad and late -> bad -> r0: late is above it in both)
                assert failed.value.versions == {"r0": None, "late": version, f"bad-{mode}": None}
                assert same(late)
            elif elastic:  # the others completed the update without it, bitwise
                assert failed.value.versions == {"r0": version, "late": version, f"bad-{mode}": None}
                assert same(r0) and same(late)
            else:
                assert mgr.versions()["r0"] is None  # torn by the failed update: no version claimed
            mgr.remove_replicas([bad])
            bad.shutdown(timeout=1)
            rep = mgr.update_weights(version=version)  # the others, without it
            assert mgr.versions() == {"r0": version, "late": version} and same(r0) and same(late)
            if elastic:
                assert not rep.rebuilt and rep.linked == []
                kept(held, [r0, late])
    finally:
        for g in groups:
            g.shutdown(timeout=2)


@pytest.mark.skipif("nixl" not in ELASTIC, reason="nixl not installed")
def test_nixl_membership_changes_touch_only_neighbours_local():
    """One trainer and a chain trainer -> a -> b -> c -> d. A join (e, at the end), a death
    mid-update (c) and a leave (b) change the NIXL connections of that replica's neighbours
    only; the others keep theirs, every replica keeps its link, and the ranks above the
    dead one complete its update."""
    trainer = LocalWorkerGroup(Trainer, 1, free_port(), name="trainer")
    a, b, d, e = (LocalWorkerGroup(Rollout, 1, name=n) for n in "abde")
    c = LocalWorkerGroup(FailingRollout, 1, "die", 3, name="c")
    groups = [trainer, a, b, c, d, e]
    mgr = CheckpointEngineManager("nixl", trainer, [a, b, c, d], timeout=8, bucket_size=1 << 16)

    def conns(*reps):
        return [call(r, "wb_connections", timeout=10)[0] for r in reps]

    def links(*reps):
        return [call(r, "wb_links", timeout=10)[0] for r in reps]

    def update(v, holders):
        call(trainer, "train_step", v, timeout=10)
        rep = mgr.update_weights(version=v)
        want = call(trainer, "weights_digest", timeout=10)[0]
        assert all(call(r, "weights_digest", timeout=10) == [want] for r in holders)
        return rep

    try:
        update(1, [a, b, c, d])
        ca, cb, cc, cd = conns(a, b, c, d)
        assert [len(x) for x in (ca, cb, cc, cd)] == [2, 2, 2, 1]  # upstream and downstream; d is last
        before = links(a, b, c, d)

        def kept(now, was, n):
            """``n`` of the connections ``was`` are still there, made under the same serial."""
            same = set(now) & set(was)
            return len(same) == n and all(now[k] == was[k] for k in same)

        mgr.add_replicas([e])  # joins at the end: only d (the old tail) meets it
        rep = update(2, [a, b, c, d, e])
        assert rep.linked == ["e"]
        now = conns(a, b, c, d)
        assert now[:3] == [ca, cb, cc]  # a, b, c: untouched
        assert kept(now[3], cd, 1) and len(now[3]) == 2  # d: + e
        cd = now[3]
        assert links(a, b, c, d) == before
        ce = conns(e)[0]

        call(trainer, "train_step", 3, timeout=10)
        with pytest.raises(UpdateFailed, match="replica 'c'") as failed:
            mgr.update_weights(version=3)  # c dies in it: a and b (above it) complete
        held = failed.value.versions  # below it: the old version if nothing arrived, else none
        assert {k: held[k] for k in "abc"} == {"a": 3, "b": 3, "c": None}
        assert {held["d"], held["e"]} <= {2, None}
        want = call(trainer, "weights_digest", timeout=10)[0]
        assert call(a, "weights_digest", timeout=10) == call(b, "weights_digest", timeout=10) == [want]
        mgr.remove_replicas([c])
        rep = update(3, [a, b, d, e])
        assert rep.linked == [] and not rep.rebuilt  # d and e failed on the data path: links kept
        assert links(a, b, d) == before[:2] + before[3:]
        na, nb, nd, ne = conns(a, b, d, e)
        assert na == ca and ne == ce  # not neighbours of c: untouched
        assert kept(nb, cb, 1) and len(nb) == 2  # b keeps a, meets d
        assert kept(nd, cd, 1) and len(nd) == 2  # d keeps e, meets b

        mgr.remove_replicas([b])  # leaves: a and d meet
        update(4, [a, d, e])
        na2, nd2, ne2 = conns(a, d, e)
        assert ne2 == ce  # not a neighbour of b: untouched
        assert kept(na2, na, 1) and len(na2) == 2  # a keeps the trainer, meets d
        assert kept(nd2, nd, 1) and len(nd2) == 2  # d keeps e, meets a
    finally:
        for g in groups:
            g.shutdown(timeout=2)


@pytest.mark.parametrize("backend", ELASTIC or ["gloo"])  # the join itself is backend-free
def test_join_from_peer_without_trainer_or_pause_local(backend):
    """A late replica gets the current version from a member that holds it: the trainer is
    busy training throughout (it answers nothing), and the member keeps generating, never
    paused; the joiner ends bitwise equal to it, and the next update includes it (an
    elastic engine links only the joiner)."""
    trainer = LocalWorkerGroup(Trainer, 1, free_port(), name="trainer")
    r0 = LocalWorkerGroup(Rollout, 2, name="r0")
    joiner = LocalWorkerGroup(Rollout, 2, name="joiner")
    groups = [trainer, r0, joiner]
    mgr = CheckpointEngineManager(backend, trainer, [r0], timeout=10, bucket_size=1 << 16)
    try:
        with pytest.raises(WeightbusError, match="no version has been sent yet"):
            mgr.join_from_peer(joiner)
        for v in (1, 2):
            call(trainer, "train_step", v, timeout=10)
            mgr.update_weights(version=v)
        want = call(r0, "weights_digest", timeout=10)[0]
        assert call(joiner, "weights_digest", timeout=10)[0] != want  # it starts elsewhere
        call(r0, "start_loop", timeout=10)
        busy = trainer.submit("train_step", [(3, 3.0)])  # training: it answers nothing meanwhile
        got = mgr.join_from_peer(joiner)
        assert call(r0, "is_paused", timeout=10) == [False, False]
        busy.result(30)  # (the join finished first: the trainer was not needed)
        samples = call(r0, "stop_loop", timeout=30)
        assert all(len(s) > 0 for s in samples)  # it generated meanwhile
        assert got["peer"] == "r0" and got["version"] == 2 and got["bytes"] > 0
        assert call(joiner, "weights_digest", timeout=10) == [want, want]
        assert mgr.versions() == {"r0": 2, "joiner": 2}
        with pytest.raises(WeightbusError, match="already a member"):
            mgr.join_from_peer(joiner)
        rep = mgr.update_weights(version=3)
        if backend in ELASTIC:
            assert rep.linked == ["joiner"] and not rep.rebuilt
        want = call(trainer, "weights_digest", timeout=10)[0]
        assert call(joiner, "weights_digest", timeout=10) == [want] * 2
        assert call(r0, "weights_digest", timeout=10) == [want] * 2
        assert mgr.versions() == {"r0": 3, "joiner": 3}
    finally:
        for g in groups:
            g.shutdown(timeout=2)


def test_delta_updates_through_the_manager_local():
    """Delta mode under the manager (gloo): the first update goes full, the next ones as
    changes (bitwise); a replica that missed an update and a late joiner make the next update
    full, after which deltas resume."""
    trainer = LocalWorkerGroup(Trainer, 1, None, name="trainer")
    r0, r1 = LocalWorkerGroup(Rollout, 1, name="r0"), LocalWorkerGroup(Rollout, 2, name="r1")
    groups = [trainer, r0, r1]
    mgr = CheckpointEngineManager("gloo", trainer, [r0, r1], timeout=20, bucket_size=1 << 16, delta=True)

    def update(v, replicas):
        call(trainer, "train_step", v, timeout=20)
        rep = mgr.update_weights(version=v)
        want = call(trainer, "weights_digest", timeout=20)[0]
        assert all(call(r, "weights_digest", timeout=20) == [want] * r.size for r in replicas)
        return rep

    try:
        assert update(1, [r0, r1]).delta is False  # nothing held yet: full
        rep = update(2, [r0, r1])
        assert rep.delta is True and rep.wire_bytes < rep.bytes  # as changes, fewer bytes
        mgr.remove_replicas([r1])
        assert update(3, [r0]).delta is True  # r1 misses version 3
        mgr.add_replicas([r1])
        assert update(4, [r0, r1]).delta is False  # r1 holds 2: full
        assert update(5, [r0, r1]).delta is True
        late = LocalWorkerGroup(Rollout, 1, name="late")
        groups.append(late)
        mgr.add_replicas([late])
        assert update(6, [r0, r1, late]).delta is False  # a late joiner: full
        assert update(7, [r0, r1, late]).delta is True
        peer_fed = LocalWorkerGroup(Rollout, 2, name="peer-fed")
        groups.append(peer_fed)
        mgr.join_from_peer(peer_fed, "r1")  # a bitwise copy of r1, chain included
        assert update(8, [r0, r1, late, peer_fed]).delta is True  # so the deltas go on
    finally:
        mgr.shutdown()
        for g in groups:
            g.shutdown(timeout=2)


@pytest.mark.parametrize("backend", ["gloo", "colocated"])
def test_fp8_rollouts_declared_and_quantized_local(backend):
    """Replicas that serve fp8 say so (read off their sinks); the FSDP2 trainers quantize
    on the way: every update bitwise as the quantizer makes it, in half the bytes of the
    linear weights. A replica serving other formats fails the update that would add it,
    naming it, and the others go on."""
    from mgr_workers import Fp8Rollout, Fp8Trainer

    T = 2 if backend == "gloo" else 1
    trainer = LocalWorkerGroup(Fp8Trainer, T, free_port(), name="trainer")
    r0 = LocalWorkerGroup(Fp8Rollout, 1, name="r0")
    groups = [trainer, r0]
    mgr = CheckpointEngineManager(backend, trainer, [r0], timeout=20, bucket_size=1 << 16)
    try:
        held = call(r0, "weights_digest", timeout=10)[0]
        kinds = {n: "block" for n in held if n + "_scale_inv" in held}
        assert kinds
        previous = None
        for version in (1, 2):
            call(trainer, "train_step", version, timeout=20)
            rep = mgr.update_weights(version=version)
            want = call(trainer, "served_digest", kinds, timeout=20)[0]
            assert call(r0, "weights_digest", timeout=10) == [want] and want != previous
            previous = want
        plain = LocalWorkerGroup(Rollout, 1, name="plain")  # serves bf16: not the same weights
        groups.append(plain)
        mgr.add_replicas([plain])
        with pytest.raises(UpdateFailed, match="replica 'plain' serves 0 weight.*first difference"):
            mgr.update_weights(version=3)
        mgr.remove_replicas([plain])
        call(trainer, "train_step", 3, timeout=20)
        rep = mgr.update_weights(version=3)
        want = call(trainer, "served_digest", kinds, timeout=20)[0]
        assert call(r0, "weights_digest", timeout=10) == [want]
        assert rep.bytes < 0.7 * call(trainer, "bf16_bytes", timeout=20)[0]
    finally:
        mgr.shutdown()
        for g in groups:
            g.shutdown(timeout=2)
