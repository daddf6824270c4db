"""The three training modes, end to end on this machine's CPUs.

    python examples/modes.py hybrid          # colocated: rollout sleeps while the trainer trains
    python examples/modes.py one-step-off    # generation of step k+1 overlaps training of step k
    python examples/modes.py fully-async     # rollout never stops; partial rollout on each update
    python examples/modes.py all [--ray]     # every mode; --ray runs the workers as Ray actors

Each mode checks, after every update, that every replica holds exactly the trainer's
weights (digest of every tensor's bits) and that every generated sample carries the
version of the weights that produced it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from rl_workers import Rollout, Trainer  # noqa: E402

from weightbus.comm import free_port  # noqa: E402
from weightbus.manager import CheckpointEngineManager  # noqa: E402
from weightbus.runtime.group import LocalWorkerGroup, call  # noqa: E402

T = 60.0  # every phase's deadline, seconds


def make_groups(trainers: int, replicas: int, ray: bool = False) -> tuple[Any, list[Any]]:
    """A trainer group (FSDP2 over gloo when trainers > 1) and replicas of one rank each."""
    if ray:
        from weightbus.runtime.ray import RayWorkerGroup
        trainer = RayWorkerGroup(Trainer, trainers, free_port(), name="trainer")
        reps = [RayWorkerGroup(Rollout, 1, name=f"replica{i}") for i in range(replicas)]
    else:
        trainer = LocalWorkerGroup(Trainer, trainers, free_port(), name="trainer")
        reps = [LocalWorkerGroup(Rollout, 1, name=f"replica{i}") for i in range(replicas)]
    return trainer, reps


def check_replicas(trainer: Any, reps: list[Any]) -> str:
    want = call(trainer, "weights_digest", timeout=T)[0]
    for r in reps:
        got = call(r, "weights_digest", timeout=T)
        assert all(g == want for g in got), f"{r.name} holds other weights than the trainer"
    return want


def hybrid(steps: int = 3, ray: bool = False) -> list[dict[str, Any]]:
    """Trainer and rollout share the device (colocated backend); the rollout frees its
    weights' memory while the trainer trains and gets them back with the update."""
    trainer, reps = make_groups(2, 2, ray)
    mgr = CheckpointEngineManager("colocated", trainer, reps, timeout=T, hybrid=True)
    rows = []
    try:
        for step in range(1, steps + 1):
            mgr.sleep_replicas()
            freed = [call(r, "held_bytes", timeout=T)[0] for r in reps]
            loss = call(trainer, "train_step", step, timeout=T)[0]
            report = mgr.update_weights(version=step)
            check_replicas(trainer, reps)
            samples = [s for r in reps for s in call(r, "generate", [[1, 2, 3]], timeout=T)[0]]
            assert all(s["version"] == step for s in samples)
            rows.append({"step": step, "loss": loss, "freed_bytes_while_training": freed,
                         "update_s": report.seconds, "transfer_s": report.phases["transfer"],
                         "versions": mgr.versions()})
            print(f"hybrid step {step}: loss {loss:.3f}, rollout held {freed} bytes while training, "
                  f"update {report.seconds * 1e3:.0f} ms, versions {mgr.versions()}", flush=True)
    finally:
        mgr.shutdown()
        for g in [trainer, *reps]:
            g.shutdown()
    return rows


def one_step_off(steps: int = 3, ray: bool = False) -> list[dict[str, Any]]:
    """Disaggregated: while the trainer trains step k, the replicas generate with the
    weights of step k-1; the sync happens between the two."""
    trainer, reps = make_groups(1, 2, ray)
    mgr = CheckpointEngineManager("gloo", trainer, reps, timeout=T)
    rows = []
    try:
        mgr.update_weights(version=0)  # start from the trainer's initial weights
        digests = {0: check_replicas(trainer, reps)}
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            gen = [r.submit("generate", [([[step, 5, 9]],)]) for r in reps]
            train = trainer.submit("train_step", [(step, 0.5)])
            samples = [s for g in gen for s in g.result(T)[0]]
            t_gen = time.perf_counter() - t0
            loss = train.result(T)[0]
            t_both = time.perf_counter() - t0
            assert all(s["version"] == step - 1 and s["digest"] == digests[step - 1] for s in samples)
            report = mgr.update_weights(version=step)
            digests[step] = check_replicas(trainer, reps)
            rows.append({"step": step, "loss": loss, "generation_s": t_gen, "train_and_generate_s": t_both,
                         "update_s": report.seconds})
            print(f"one-step-off step {step}: generated with v{step - 1} in {t_gen:.2f}s while training "
                  f"(both {t_both:.2f}s), update {report.seconds * 1e3:.0f} ms", flush=True)
    finally:
        mgr.shutdown()
        for g in [trainer, *reps]:
            g.shutdown()
    return rows


def fully_async(steps: int = 3, ray: bool = False) -> dict[str, Any]:
    """The replicas generate without stopping; after every trainer step the manager
    aborts in-flight requests, updates, and resumes (partial rollout). Every sample is
    tagged with the version whose weights produced it, start to end."""
    trainer, reps = make_groups(1, 2, ray)
    mgr = CheckpointEngineManager("gloo", trainer, reps, timeout=T, pause_mode="abort")
    try:
        mgr.update_weights(version=0)
        digests = {0: check_replicas(trainer, reps)}
        for r in reps:
            call(r, "start_loop", timeout=T)
        updates = []
        for step in range(1, steps + 1):
            call(trainer, "train_step", step, 0.3, timeout=T)
            updates.append(mgr.update_weights(version=step).seconds)
            digests[step] = call(trainer, "weights_digest", timeout=T)[0]
        time.sleep(0.3)
        samples = [s for r in reps for s in call(r, "stop_loop", timeout=T)[0]]
        aborted = [a for r in reps for a in call(r, "wb_version", timeout=T)]
        for s in samples:  # no sample mixes versions, and each names the weights it used
            assert s["digest"] == s["digest_end"] == digests[s["version"]], s["version"]
        seen = sorted({s["version"] for s in samples})
        print(f"fully-async: {len(samples)} samples from versions {seen}, "
              f"updates {[round(u * 1e3) for u in updates]} ms", flush=True)
        return {"samples": len(samples), "versions": seen, "update_s": updates, "final": aborted}
    finally:
        mgr.shutdown()
        for g in [trainer, *reps]:
            g.shutdown()


def fully_async_cache(steps: int = 3, ray: bool = False) -> dict[str, Any]:
    """Fully-async without waiting: the trainer publishes each version into a host
    shared-memory cache (``shm``) and goes on training; each replica takes the newest
    version when it is ready: replica 0 after every step, replica 1 (slower) every other
    step, so it lags and skips versions. Every sample is tagged with its version."""
    trainer, reps = make_groups(1, 2, ray)
    mgr = CheckpointEngineManager("shm", trainer, reps, timeout=T, cache_name=f"modes{os.getpid()}")
    try:
        mgr.publish(version=0)
        mgr.pull()
        digests = {0: check_replicas(trainer, reps)}
        for r in reps:
            call(r, "start_loop", timeout=T)
        blocked, lag = [], []
        for step in range(1, steps + 1):
            call(trainer, "train_step", step, 0.3, timeout=T)
            t0 = time.perf_counter()
            mgr.publish(version=step)  # returns without any replica
            blocked.append(time.perf_counter() - t0)
            digests[step] = call(trainer, "weights_digest", timeout=T)[0]
            mgr.pull([reps[0]] if step % 2 else reps)  # the slow replica pulls every other step
            lag.append(mgr.versions())
        time.sleep(0.3)
        samples = [s for r in reps for s in call(r, "stop_loop", timeout=T)[0]]
        for s in samples:  # no sample mixes versions, and each names the weights it used
            assert s["digest"] == s["digest_end"] == digests[s["version"]], s["version"]
        seen = sorted({s["version"] for s in samples})
        print(f"fully-async-cache: {len(samples)} samples from versions {seen}, trainer blocked "
              f"{[round(b * 1e3) for b in blocked]} ms per publish, versions held per step {lag}", flush=True)
        return {"samples": len(samples), "versions": seen, "blocked_s": blocked, "lag": lag}
    finally:
        mgr.shutdown()
        for g in [trainer, *reps]:
            g.shutdown()


MODES = {"hybrid": hybrid, "one-step-off": one_step_off, "fully-async": fully_async,
         "fully-async-cache": fully_async_cache}

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=[*MODES, "all"])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ray", action="store_true", help="workers as Ray actors on a local Ray cluster")
    a = p.parse_args()
    for name, fn in MODES.items():
        if a.mode in (name, "all"):
            fn(a.steps, a.ray)
