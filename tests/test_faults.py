"""Faults at every phase, across real processes: every survivor raises within its deadline
(plus a small margin) naming the lost peer and the phase, nothing hangs, nothing is left in
/dev/shm, healthy replicas are never left paused, no replica claims a version it does not
fully hold, and the next update is bitwise right.

The engine-level cases of a receiver that dies or hangs mid-update live in
test_engines.py; the manager's dying and hanging replicas in test_manager.py. This file
adds the trainer side, group formation, and the manager's pause / sink / source faults.
"""

from __future__ import annotations

import os
import re
import signal
import time

import mgr_workers
import pytest
import torch.multiprocessing as mp
import workers
import workers_faults
from mgr_workers import PauseFails, ResumeFails, SinkRaises, SinkRaisesMidStream, SourceRaises
from rl_workers import Rollout

from weightbus import UpdateFailed
from weightbus.manager import CheckpointEngineManager
from weightbus.packing import buffers
from weightbus.runtime.group import LocalWorkerGroup, call

DEADLINE = 2.5
#: how a survivor's error names the phase it lost its peer in
PHASE_WORDS = {"formation": re.compile("rendezvous|forming"), "header": re.compile("header"),
               "mid-update": re.compile("bucket \\d+"), "final-status": re.compile("finish")}
EITHER = re.compile("header|bucket \\d+")


def _shm_of(pid: int) -> list[str]:
    try:
        return [n for n in os.listdir("/dev/shm") if n.startswith(f"wbus_{pid}_")]
    except FileNotFoundError:
        return []


try:
    import nixl  # noqa: F401
    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False
try:
    from mooncake.engine import TransferEngine  # noqa: F401
    HAVE_MOONCAKE = True
except ImportError:
    HAVE_MOONCAKE = False

# (backend, who is lost, how): the trainer or a rollout, SIGKILLed or SIGSTOPped
# (a stopped peer is found by the same deadline on every backend: once, on colocated, where
# it also holds shared memory)
LOST = [(b, w, h) for b in ("colocated", "gloo") for w in ("trainer", "rollout")
        for h in (("kill", "stop") if b == "colocated" else ("kill",))]
LOST += [("nixl", w, "kill") for w in ("trainer", "rollout")] if HAVE_NIXL else []
LOST += [("mooncake", w, "kill") for w in ("trainer", "rollout")] if HAVE_MOONCAKE else []


def _lose_one(port: int, backend: str, lost: int, phase: str, how: str, delta: bool = False,
              sharded: bool = False) -> tuple[dict, list]:
    """Ranks 0-2 in ``workers_faults.peer_lost``, rank ``lost`` lost at ``phase``: every
    survivor's report (each must report), and the processes (all ended)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = (port, backend, lost, phase, how, DEADLINE, out)
    procs = [ctx.Process(target=workers_faults.peer_lost, args=(r, *args),
                         kwargs={"delta": delta, "sharded": sharded}) for r in range(3)]
    for p in procs:
        p.start()
    survivors = {r for r in range(3) if r != lost}
    results = {}
    t_end = time.monotonic() + 90
    while len(results) < len(survivors) and time.monotonic() < t_end:
        try:
            rank, res = out.get(timeout=1)
            results[rank] = res
        except Exception:  # noqa: BLE001 - queue.Empty
            if not any(procs[r].is_alive() for r in survivors) and out.empty():
                break
    if how == "stop" and procs[lost].is_alive():
        os.kill(procs[lost].pid, signal.SIGKILL)
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
    assert set(results) == survivors, results
    return results, procs


@pytest.mark.parametrize("phase", ["formation", "header", "mid-update", "final-status"])
@pytest.mark.parametrize("backend,who,how", LOST, ids=["-".join(x) for x in LOST])
def test_peer_lost_at_every_phase(port, backend, phase, who, how):
    """1 trainer, 2 rollouts. After one good update a peer (the trainer, or rollout 2) is
    SIGKILLed or SIGSTOPped at ``phase`` of the next; every survivor raises within the
    deadline naming the phase, claims no version it does not hold, and the trainer's
    shared memory is gone from /dev/shm (colocated)."""
    lost = 0 if who == "trainer" else 2
    results, procs = _lose_one(port, backend, lost, phase, how)
    if backend in ("mooncake", "nixl") and who == "rollout" and phase != "formation":
        # each replica has its own group (nixl: rollout 2 is last in the chain, so nothing
        # is below it): the other one completes the update, bitwise
        # checked by its sink; the trainer names the replica it lost and when
        assert results[1]["error"] is None and results[1]["version"] == 2, results[1]
        del results[1]
        assert "failed on replica 'r1'" in results[0]["error"], results[0]
    elif backend in ("mooncake", "nixl") and who == "rollout":
        # rollout 1 linked to the trainer; the trainer, waiting for rollout 2, gives up at
        # formation, and rollout 1 at the header of the first update (both in time)
        assert "header" in results[1]["error"] and results[1]["seconds"] < DEADLINE * 2 + 5, results[1]
        del results[1]
    for rank, res in results.items():
        assert res["first"] == "ok", res
        err, seconds = res["error"], res["seconds"]
        assert err is not None, res
        assert seconds < DEADLINE * 2 + 5, res  # the deadline plus a margin, never a hang
        # names the phase it lost its peer in: a rollout lost before the header is noticed by
        # the root there, by the other rollouts at the first bucket (the header never waits
        # for a fellow receiver)
        words = EITHER if (who, phase) == ("rollout", "header") else PHASE_WORDS[phase]
        if (backend, who, rank, phase) == ("nixl", "rollout", 0, "mid-update"):
            # rollout 1 feeds rollout 2: the trainer hears it from rollout 1 (which names the
            # bucket), or at the final status if it got there first
            words = re.compile("bucket \\d+|finish")
        assert words.search(err), err
        assert ("trainer" if rank == 0 else "rollout") + " rank" in err or "rendezvous" in err, err
        if rank and phase != "formation":
            # never a version it does not hold: the old one if nothing was written
            assert res["version"] in (1, None), res
            if phase == "header" and who == "trainer":
                assert res["version"] == 1, res
    if phase == "formation" and how == "stop":
        # stopped (alive) while the others gave up, then killed: its segments wait for the
        # next weightbus process on the host, which sweeps them (as this one does now)
        buffers.sweep_stale_segments()
    for p in procs:
        assert _shm_of(p.pid) == []


@pytest.mark.parametrize("phase", ["header", "mid-update", "final-status"])
@pytest.mark.parametrize("who", ["trainer", "rollout"])
def test_peer_lost_in_a_delta_update(port, who, phase):
    """Delta mode (gloo, in rounds: a receiver waits between them on the next round's
    agreement): after one good update the trainer or rollout 2 is SIGKILLed at ``phase`` of
    a delta update; every survivor raises within the deadline naming the phase, and claims
    no version it does not hold."""
    results, _ = _lose_one(port, "gloo", 0 if who == "trainer" else 2, phase, "kill", delta=True)
    # (right after the header, the ranks agree on the version held; a rollout lost while it
    # patches is noticed by the other rollout at the final status, the broadcasts having
    # reached it)
    words = {"header": re.compile("header|delta: agreeing|bucket \\d+"),
             "mid-update": re.compile("bucket" if who == "trainer" else "bucket|finish"),
             "final-status": PHASE_WORDS["final-status"]}
    _survivors_failed_in_time(results, words[phase])


def _survivors_failed_in_time(results: dict, words: re.Pattern) -> None:
    """Every survivor had its first update, then raised within the deadline naming the
    phase (``words``) and its own side, and claims no version it does not hold."""
    for rank, res in results.items():
        assert res["first"] == "ok", res
        err = res["error"]
        assert err is not None and res["seconds"] < DEADLINE * 2 + 5, res  # in time, never a hang
        assert words.search(err), (rank, err)
        assert ("trainer" if rank == 0 else "rollout") + " rank" in err, err
        if rank:
            assert res["version"] in (1, None), res


@pytest.mark.parametrize("phase", ["header", "mid-update", "final-status"])
@pytest.mark.parametrize("who", ["trainer", "rollout"])
def test_peer_lost_in_a_sharded_update(port, who, phase):
    """Sharded receive (gloo, point to point: each rollout keeps its rows): after one good
    update the trainer or rollout 2 is SIGKILLed at ``phase``; every survivor raises within
    the deadline naming the phase, and claims no version it does not hold."""
    results, _ = _lose_one(port, "gloo", 0 if who == "trainer" else 2, phase, "kill", sharded=True)
    # (a rollout lost mid-update is noticed by the trainer at a bucket it sends it, or at
    # the final status; by the other rollout, which gets its own buckets, at the final status)
    _survivors_failed_in_time(results, {"header": EITHER, "mid-update": re.compile("bucket \\d+|finish"),
                                        "final-status": PHASE_WORDS["final-status"]}[phase])


def _formation_of(target, ranks, *args) -> list:
    """Each rank's (rank, error, seconds) from ``target`` in a process of its own."""
    ctx = mp.get_context("spawn")
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
