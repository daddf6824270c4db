"""Soak: many consecutive updates with real optimizer steps, replicas joining and leaving on
the way, every update verified bitwise on every replica; resident memory, open file
descriptors and /dev/shm entries of every long-lived process reported at the start and the
end, and required to stay flat.

CI runs a short form; the full one (200 updates per backend) is
``WEIGHTBUS_SOAK_UPDATES=200 python -m pytest -q tests/test_soak.py -s``.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from rl_workers import Rollout, Trainer  # noqa: E402

from weightbus.manager import CheckpointEngineManager  # noqa: E402
from weightbus.runtime.group import LocalWorkerGroup, call  # noqa: E402

UPDATES = int(os.environ.get("WEIGHTBUS_SOAK_UPDATES", "24"))
#: every this many updates a replica joins, and the oldest leaves (its processes end)
CHURN = 6


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _shm(pids: set[int]) -> int:
    """weightbus's segments in /dev/shm made by these processes (a segment's name carries its
    maker's pid: other tests' segments, coming and going beside this one, are not counted)."""
    try:
        return sum(1 for n in os.listdir("/dev/shm") if n.startswith("wbus_") and n.split("_")[1].isdigit()
                   and int(n.split("_")[1]) in pids)
    except FileNotFoundError:
        return 0


def _usage(groups) -> dict[str, tuple[int, int]]:
    return {f"{g.name}/{i}": (_rss_kib(pid), _fds(pid)) for g in groups for i, pid in enumerate(g.pids())}


try:
    import nixl  # noqa: F401
    NIXL = ["nixl"]
except ImportError:
    NIXL = []
try:
    from mooncake.engine import TransferEngine  # noqa: F401
    MOONCAKE = ["mooncake"]
except ImportError:
    MOONCAKE = []


@pytest.mark.parametrize("backend", ["gloo", "colocated", *NIXL, *MOONCAKE])
def test_soak(backend):
    trainer = LocalWorkerGroup(Trainer, 1, name="trainer")
    stay = LocalWorkerGroup(Rollout, 2, name="stay")  # a replica of 2 ranks, there throughout
    churn = [LocalWorkerGroup(Rollout, 1, name="churn0")]
    mgr = CheckpointEngineManager(backend, trainer, [stay, *churn], timeout=30, bucket_size=1 << 16)
    made = 1
    verified = rebuilt = 0
    pids = {os.getpid(), *(p for g in (trainer, stay, *churn) for p in g.pids())}
    shm_before = _shm(pids)
    try:
        for v in range(1, UPDATES + 1):
            call(trainer, "train_step", v, timeout=30)
            report = mgr.update_weights(version=v)
            rebuilt += report.rebuilt
            want = call(trainer, "weights_digest", timeout=30)[0]
            for rep in [stay, *churn]:
                assert call(rep, "weights_digest", timeout=30) == [want] * rep.size, (v, rep.name)
                verified += rep.size
            assert set(mgr.versions().values()) == {v}
            if v == 2:  # warmed up: the baseline every later reading is compared with
                start, shm_start = _usage([trainer, stay]), _shm(pids)
                stay_links = call(stay, "wb_links", timeout=30)
                stay_conns = call(stay, "wb_connections", timeout=30)
            if v % CHURN == 0 and v < UPDATES:
                new = LocalWorkerGroup(Rollout, 1, name=f"churn{made}")
                pids.update(new.pids())
                made += 1
                mgr.add_replicas([new])
                old = churn.pop(0)
                mgr.remove_replicas([old])
                old.shutdown(timeout=5)
                churn.append(new)
        end, shm_end = _usage([trainer, stay]), _shm(pids)
        if backend in MOONCAKE + NIXL:  # elastic: the churn never touched the staying replica's links
            assert call(stay, "wb_links", timeout=30) == stay_links and rebuilt == 1, (stay_links, rebuilt)
        if backend in NIXL:  # chain trainer -> stay 0 -> stay 1 -> churn: stay 0 is no churner's neighbour
            assert call(stay, "wb_connections", timeout=30)[0] == stay_conns[0]
        print(f"\nsoak {backend}: {UPDATES} updates, {verified} replica ranks verified bitwise, "
              f"{made - 1} joins and leaves, {rebuilt} re-formations; /dev/shm entries "
              f"{shm_before} -> {shm_start} -> {shm_end}")
        for k in start:
            (rss0, fd0), (rss1, fd1) = start[k], end[k]
            print(f"  {k}: RSS {rss0 / 1024:.1f} -> {rss1 / 1024:.1f} MiB, fds {fd0} -> {fd1}")
            assert fd1 <= fd0 + 2, (k, fd0, fd1)  # no descriptor kept per update or per member
            assert rss1 - rss0 < 64 * 1024, (k, rss0, rss1)  # no memory kept per update
        assert shm_end <= shm_start  # nothing left in /dev/shm per update or per member
    finally:
        mgr.shutdown()
        for g in [trainer, stay, *churn]:
            g.shutdown(timeout=5)
