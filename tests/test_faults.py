"""Faults at every phase, across real processes: every survivor raises within its deadline
(plus a small margin) naming the lost peer and the phase, nothing hangs, nothing is left in
/dev/shm, healthy replicas are never left paused, no replica claims a version it does not
fully hold, and the next update is bitwise right.

The engine-level cases of a receiver that dies or hangs mid-update live in
test_engines.py; the manager's dying and hanging replicas in test_manager.py. This file
adds the trainer side, group formation, and the manager's pause / sink / source faults.
"""

from __future__ import annotations

import re
import time

import mgr_workers
import pytest
import workers
import workers_faults
import workers_shards
from faults_common import (
    DEADLINE,
    EITHER,
    LOST,
    PHASE_WORDS,
    PHASES,
    check_peer_lost,
    lose_one,
    survivors_failed_in_time,
)
from mgr_workers import PauseFails, ResumeFails, SinkRaises, SinkRaisesMidStream, SourceRaises
from rl_workers import Rollout

from weightbus import UpdateFailed
from weightbus.manager import CheckpointEngineManager
from weightbus.runtime.group import LocalWorkerGroup, call, process_context


@pytest.mark.parametrize("phase", PHASES)
@pytest.mark.parametrize("backend,who,how", [x for x in LOST if x[0] != "colocated"],
                         ids=["-".join(x) for x in LOST if x[0] != "colocated"])
def test_peer_lost_at_every_phase(port, backend, phase, who, how):
    """1 trainer, 2 rollouts (gloo, nixl, mooncake; colocated: test_faults_colocated.py).
    After one good update a peer (the trainer, or rollout 2) is SIGKILLed at ``phase`` of
    the next; every survivor raises within the deadline naming the phase and claims no
    version it does not hold."""
    check_peer_lost(port, backend, phase, who, how)


@pytest.mark.parametrize("phase", ["header", "mid-update", "final-status"])
@pytest.mark.parametrize("who", ["trainer", "rollout"])
def test_peer_lost_in_a_delta_update(port, who, phase):
    """Delta mode (gloo, in rounds: a receiver waits between them on the next round's
    agreement): after one good update the trainer or rollout 2 is SIGKILLed at ``phase`` of
    a delta update; every survivor raises within the deadline naming the phase, and claims
    no version it does not hold."""
    results, _ = lose_one(port, "gloo", 0 if who == "trainer" else 2, phase, "kill", delta=True)
    # (right after the header, the ranks agree on the version held; a rollout lost while it
    # patches is noticed by the other rollout at the final status, the broadcasts having
    # reached it)
    words = {"header": re.compile("header|delta: agreeing|bucket \\d+"),
             "mid-update": re.compile("bucket" if who == "trainer" else "bucket|finish"),
             "final-status": PHASE_WORDS["final-status"]}
    survivors_failed_in_time(results, words[phase])


@pytest.mark.parametrize("phase", ["header", "mid-update", "final-status"])
@pytest.mark.parametrize("who", ["trainer", "rollout"])
def test_peer_lost_in_a_sharded_update(port, who, phase):
    """Sharded receive (gloo, point to point: each rollout keeps its rows): after one good
    update the trainer or rollout 2 is SIGKILLed at ``phase``; every survivor raises within
    the deadline naming the phase, and claims no version it does not hold."""
    results, _ = lose_one(port, "gloo", 0 if who == "trainer" else 2, phase, "kill", sharded=True)
    # (a rollout lost mid-update is noticed by the trainer at a bucket it sends it, or at
    # the final status; by the other rollout, which gets its own buckets, at the final status)
    survivors_failed_in_time(results, {"header": EITHER, "mid-update": re.compile("bucket \\d+|finish"),
                                        "final-status": PHASE_WORDS["final-status"]}[phase])


@pytest.mark.parametrize("who", ["trainer", "rollout"])
def test_peer_lost_in_a_delta_update_of_a_sharded_group(port, who, phase="mid-update"):
    """Delta mode on sharded receive (gloo: each rollout patches its own rows): after one
    good (full) update the trainer (while it diffs) or rollout 2 (after its first patch) is
    SIGKILLed mid-update; every survivor raises within the deadline naming where, and
    claims no version it does not hold. (The header and the final status are the sharded
    and delta paths' own, lost there in the tests above.)"""
    results, _ = lose_one(port, "gloo", 0 if who == "trainer" else 2, phase, "kill", delta=True, sharded=True)
    # (a trainer lost while it diffs: the others at the agreement on the buckets' sizes; a
    # rollout lost after its first patch: the trainer at a bucket it sends it, or at the
    # final status, the other rollout at the final status)
    words = {"mid-update": re.compile("agreeing on the sharded buckets|bucket \\d+|finish"),
             "final-status": PHASE_WORDS["final-status"]}
    survivors_failed_in_time(results, words[phase])


def _formation_of(target, ranks, *args) -> list:
    """Each rank's (rank, error, seconds) from ``target`` in a process of its own."""
    ctx = process_context()
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, out)) for r in ranks]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    return got


def test_rank_that_never_joins_fails_formation_in_time(port):
    """2 of 3 ranks show up: both fail within the deadline naming the formation."""
    for rank, err, seconds in _formation_of(workers_faults.partial_group, (0, 1), port, DEADLINE):
        assert seconds < DEADLINE * 2 + 5, (rank, err, seconds)
        assert "rank" in err, err


def test_rank_that_fails_its_setup_fails_formation_at_once(port):
    """A rank that reaches the rendezvous but cannot set up (Rendezvous.fail) makes every
    rank, itself too, fail at once, naming it and its reason: not at the deadline."""
    slow = 30.0  # the deadline: nobody may wait for it
    for rank, err, seconds in _formation_of(workers_faults.group_with_a_failing_rank, range(3), port, slow):
        assert seconds < slow / 2, (rank, err, seconds)
        assert "rank 2 failed: vLLM worker 0: cannot make the engine: out of memory" in err, (rank, err)


def test_vllm_worker_outcomes_name_every_failure(port):
    """The outcomes a vLLM driver gathers from the group's store (real TCPStore): every
    failed worker named once per cause, a silent one named as such, torn vs kept."""
    from weightbus.comm import serve_store
    from weightbus.integrations import outcomes
    from weightbus.integrations.vllm.loader import KEPT
    store = serve_store(10)
    o = outcomes.Outcome
    outcomes.post(store, "p", "update", 7, o(0, False, f"vLLM worker 0: rejected [{KEPT}]"))
    outcomes.post(store, "p", "update", 7, o(1, False, f"vLLM worker 1: rejected [{KEPT}]"))
    outcomes.post(store, "p", "update", 6, o(2))  # another update's: not this one's
    t0 = time.monotonic()
    got = outcomes.gather(store, "p", "update", 7, range(3), timeout=0.5)
    assert time.monotonic() - t0 < 5
    msg = outcomes.failure_of(got, "update to version 7")
    assert msg.startswith("update to version 7 failed on 3 vLLM worker(s): ")
    assert "rollout rank 0: vLLM worker 0: rejected; rollout rank 1: vLLM worker 1: rejected" in msg
    assert "rollout rank 2 reported no outcome of update within 0.5s" in msg and "torn" in msg
    both = outcomes.failure_of(got[:2], "update to version 7")
    assert both.endswith(f"[{KEPT}]")
    same = [o(0, False, "trainer rank 0 died", kept=False), o(1, False, "trainer rank 0 died")]
    assert "rollout ranks 0, 1: trainer rank 0 died [" in outcomes.failure_of(same, "u")
    assert outcomes.failure_of([o(0), o(1)], "u") is None


def test_manager_resumes_healthy_replicas_whatever_fails():
    timeout = 12  # group formation on a loaded 2-core CI host needs headroom
    trainer = LocalWorkerGroup(SourceRaises, 1, 6, name="trainer")
    healthy = LocalWorkerGroup(Rollout, 2, name="healthy")
    groups = [trainer, healthy]
    mgr = CheckpointEngineManager("gloo", trainer, [healthy], timeout=timeout, bucket_size=1 << 16)

    def same() -> bool:
        want = call(trainer, "weights_digest", timeout=10)[0]
        return call(healthy, "weights_digest", timeout=10) == [want] * healthy.size

    def paused() -> list[bool]:
        return call(healthy, "is_paused", timeout=10)

    try:
        mgr.update_weights(version=1)
        assert same() and paused() == [False, False]
        # 2: a replica's pause raises; 3: it hangs; 4: it dies
        for version, mode in ((2, "raise"), (3, "hang"), (4, "die")):
            bad = LocalWorkerGroup(PauseFails, 1, mode, 1, name=f"pause-{mode}")
            groups.append(bad)
            mgr.add_replicas([bad])
            call(trainer, "train_step", version, timeout=10)
            t0 = time.monotonic()
            with pytest.raises(UpdateFailed, match=f"replica 'pause-{mode}'") as info:
                mgr.update_weights(version=version)
            assert time.monotonic() - t0 < timeout * 2 + 5
            assert paused() == [False, False], mode  # resumed before update_weights raised
            assert "healthy" in info.value.resumed
            assert info.value.versions["healthy"] == 1 and info.value.versions[f"pause-{mode}"] is None
            mgr.remove_replicas([bad])
            bad.shutdown(timeout=1)
        # 5: one replica's sink raises on one tensor: the update fails everywhere, the
        # healthy replica is resumed and claims no version (it was written, not agreed)
        bad = LocalWorkerGroup(SinkRaises, 1, "head.weight", name="sink-raises")
        groups.append(bad)
        mgr.add_replicas([bad])
        call(trainer, "train_step", 5, timeout=10)
        with pytest.raises(UpdateFailed, match="'sink-raises'.*cannot load head.weight") as info:
            mgr.update_weights(version=5)
        assert paused() == [False, False]
        assert info.value.versions == {"healthy": None, "sink-raises": None}
        mgr.remove_replicas([bad])
        bad.shutdown(timeout=1)
        mgr.update_weights(version=5)
        assert same() and mgr.versions() == {"healthy": 5}
        # 6: the trainer's weights_source() raises: every rank hears it at the header, at
        # once (not after the deadline), and the replica keeps version 5, untouched
        call(trainer, "train_step", 6, timeout=10)
        t0 = time.monotonic()
        with pytest.raises(UpdateFailed, match=r"weights_source\(\) raised KeyError.*optimizer state"):
            mgr.update_weights(version=6)
        assert time.monotonic() - t0 < timeout / 2
        assert paused() == [False, False] and mgr.versions() == {"healthy": 5} and same() is False
        mgr.update_weights(version=7)
        assert same() and mgr.versions() == {"healthy": 7}
        # 8: a replica's resume raises after the weights arrived everywhere
        bad = LocalWorkerGroup(ResumeFails, 1, 1, name="resume-raises")
        groups.append(bad)
        mgr.add_replicas([bad])
        call(trainer, "train_step", 8, timeout=10)
        with pytest.raises(UpdateFailed, match="version 8 reached every replica.*'resume-raises'") as info:
            mgr.update_weights(version=8)
        assert paused() == [False, False] and info.value.versions == {"healthy": 8, "resume-raises": 8}
        assert info.value.resumed == ["healthy"] and same()
        mgr.remove_replicas([bad])
        bad.shutdown(timeout=1)
        # 9: a replica's own sink raises mid-stream and leaves the stream open: every rank
        # hears why at once (not the trainer at its deadline), and the next update
        # recovers that replica (it is not left with an update still open)
        bad = LocalWorkerGroup(SinkRaisesMidStream, 1, 9, name="sink-mid")
        groups.append(bad)
        mgr.add_replicas([bad])
        call(trainer, "train_step", 9, timeout=10)
        t0 = time.monotonic()
        with pytest.raises(UpdateFailed, match="trainer rank 0 raised.*rollout rank .*sink broke mid-stream"):
            mgr.update_weights(version=9)
        assert time.monotonic() - t0 < timeout / 2
        mgr.update_weights(version=10)
        want = call(trainer, "weights_digest", timeout=10)[0]
        assert call(bad, "weights_digest", timeout=10) == [want]
        assert mgr.versions() == {"healthy": 10, "sink-mid": 10}
    finally:
        for g in groups:
            g.shutdown(timeout=2)


def test_worker_module_is_importable():
    assert mgr_workers.PauseFails and workers_faults.peer_lost


def test_spawn_stops_the_others_soon_after_a_rank_fails():
    """The demo's and the tests' process launcher: ranks waiting on a failed one are killed
    after a grace period (not at the whole timeout), and the error names both."""
    from weightbus import WeightbusError
    from weightbus.runtime.local import spawn
    t0 = time.monotonic()
    with pytest.raises(WeightbusError, match="(?s)rank 0 failed \\(injected\\).*rank 1: still running 2s "
                                             "after another rank failed"):
        spawn(workers.fails_or_waits, 2, timeout=300, grace=2)
    assert time.monotonic() - t0 < 60


def test_a_relay_node_dying_mid_update_is_named_and_the_others_go_on():
    """The manager over 4 replicas relaying shards in a chain (relay=1: head -> mid -> tail
    -> end). ``mid`` dies while its update is in flight: every rank fails the update within
    its deadline, naming ``mid``; ``tail``, cut off, passes abort notices on, so ``end``
    hears why from it. Without ``mid`` the next update lands bitwise on the others (``tail``
    now fed by ``head``); a replica that joins from a live peer catches up and is relayed to
    from the next update on."""
    timeout = 20
    ws = workers_shards
    trainer = LocalWorkerGroup(ws.ToyTrainer, 1, name="trainer")
    head, mid, tail, end = (LocalWorkerGroup(ws.ToyTPRollout, 1, *([2] if n == "mid" else []), name=n)
                            for n in ("head", "mid", "tail", "end"))
    groups = [trainer, head, mid, tail, end]
    mgr = CheckpointEngineManager("gloo", trainer, [head, mid, tail, end], timeout=timeout, relay=1,
                                  bucket_size=1024)  # (the block spans several buckets)
    model = sum(t.numel() * 4 for t in ws.weights(1).values())
    try:
        call(trainer, "train_step", 1, timeout=30)
        mgr.update_weights(version=1)
        for g in (head, mid, tail, end):
            assert call(g, "wrong", 1, timeout=30) == [[]], g.name
        call(trainer, "train_step", 2, timeout=30)
        t0 = time.monotonic()
        with pytest.raises(UpdateFailed, match="replica 'mid': mid rank 0 died") as info:
            mgr.update_weights(version=2)
        # (a dead rank costs its peers the deadline of the collective in flight, as a dead
        # replica does under broadcast: bounded, not a hang)
        assert time.monotonic() - t0 < timeout * 1.5 + 5
        assert re.search(r"end rank 0 raised .*relayed: .*receive bucket \d+ from rollout rank 1 \(relay\)",
                         str(info.value)), str(info.value)
        # (whether a bucket ``mid`` forwarded reached ``tail`` before it died is a race: a
        # rank that wrote none of version 2 still holds version 1 whole, and says so)
        for g in (tail, end):
            v = info.value.versions[g.name]
            assert v is None or (v == 1 and call(g, "wrong", 1, timeout=30) == [[]]), (g.name, v)
        mgr.remove_replicas([mid])
        mid.shutdown(timeout=1)
        call(trainer, "train_step", 3, timeout=30)
        mgr.update_weights(version=3)
        for g in (head, tail, end):
            assert call(g, "wrong", 3, timeout=30) == [[]], g.name
        assert mgr.versions() == {"head": 3, "tail": 3, "end": 3}
        late = LocalWorkerGroup(ws.ToyTPRollout, 1, name="late")
        groups.append(late)
        mgr.join_from_peer(late)
        assert call(late, "wrong", 3, timeout=30) == [[]]
        call(trainer, "train_step", 4, timeout=30)
        report = mgr.update_weights(version=4)
        for g in (head, tail, end, late):
            assert call(g, "wrong", 4, timeout=30) == [[]], g.name
            assert call(g, "received", timeout=30) == [model + 0]  # (TP=1: the whole block)
        assert report.bytes == model
    finally:
        mgr.shutdown()
        for g in groups:
            g.shutdown(timeout=2)
