"""Where one warm update spends its host time, on each side: cProfile around one update
after a warm-up, in each process, for a stress preset (many small tensors) or a model preset.

    python benchmarks/profile_update.py --backend gloo --tensors 100000 --tensor-bytes 1024
    python benchmarks/profile_update.py --backend colocated --tensors 20000
    python benchmarks/profile_update.py --backend colocated --direct --preset 30b-a3b --layers 24  (GPU)
    python benchmarks/profile_update.py --backend colocated --preset 30b-a3b --layers 24 --timeline  (GPU)
    python benchmarks/profile_update.py --backend colocated --direct --preset 30b-a3b --layers 24 --phases 5

Prints the top functions by own time on the trainer and the rollout (CPU machines:
gloo / shared memory; the same code runs on a GPU). With ``--timeline`` (GPU), a second
warm update runs under torch's profiler instead: each side's GPU time (its kernels and
copies, as a union of intervals), the span from its first to its last, and its top kernels,
which shows how much of an update the GPU is busy and whose work it is. With ``--phases``,
``--iters`` warm updates run with the engine's steps timed on both sides on one clock (the
host's monotonic clock, which both processes share): when each side entered and left each
step, as offsets from the trainer's start, medians over the updates; that is where an
update's wall time goes between the two processes, waits included.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from weightbus import CheckpointEngineRegistry, ModuleSource
from weightbus.planning import presets
from weightbus.runtime.local import Rendezvous, connect, spawn
from weightbus.tools.bench import _update_fn


def _timeline(update) -> str:
    """One update under torch's profiler: this process's GPU work, busy time and span."""
    from torch.profiler import ProfilerActivity, profile
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        update()
    wall = (time.perf_counter() - t0) * 1e3
    spans = sorted((e.time_range.start, e.time_range.end) for e in p.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end, first, last = 0.0, None, None, None
    for s, e in spans:
        first = s if first is None else first
        last = e if last is None else max(last, e)
        if end is None or s > end:
            busy += e - s
            end = e
        elif e > end:
            busy += e - end
            end = e
    by: dict[str, list[float]] = {}
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by.setdefault(e.name[:70], []).append((e.time_range.end - e.time_range.start) / 1e3)
    lines = [f"  wall {wall:.1f} ms; GPU busy {busy / 1e3:.2f} ms in {len(spans)} operations, "
             f"first to last {((last or 0) - (first or 0)) / 1e3:.2f} ms"]
    for name, ms in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:8]:
        lines.append(f"  {sum(ms):8.2f} ms  x{len(ms):<5} {name}")
    return "\n".join(lines)


#: the engine steps --phases times, in the order an update runs them (those an engine lacks
#: are left out); generators are not among them (a call would time only their creation)
_STEPS = ("_header_flag", "_exchange_header", "_open_receive", "_before_bytes", "_transfer",
          "_write_fused", "_held_tensors", "_direct_copies", "_finish", "_direct_batch")


def _traced(engine, marks: list) -> None:
    """Time each of ``_STEPS`` on ``engine`` (instance attributes over its methods), and
    every CopyList.run, into ``marks`` as (step, entered, left)."""
    from weightbus.packing import buffers

    def wrap(fn, name):
        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                marks.append((name, t, time.perf_counter()))
        return timed
    for name in _STEPS:
        fn = getattr(engine, name, None)
        if fn is not None:
            setattr(engine, name, wrap(fn, name))
    if not getattr(buffers.CopyList.run, "_traced", False):
        run = buffers.CopyList.run

        def copy_run(self, *a, **k):
            t = time.perf_counter()
            try:
                return run(self, *a, **k)
            finally:
                marks.append(("CopyList.run", t, time.perf_counter()))
        copy_run._traced = True
        buffers.CopyList.run = copy_run


def _phases_table(per_rank: list[list[list[tuple[str, float, float]]]]) -> str:
    """Medians over updates of each side's steps, as offsets (ms) from the trainer's start."""
    import statistics
    lines = []
    for rank, updates in enumerate(per_rank):
        rows: dict[str, list[tuple[float, float]]] = {}
        for u, marks in enumerate(updates):
            t0 = per_rank[0][u][0][1]  # the trainer's "update" mark opens each update
            for name, a, b in marks:
                rows.setdefault(name, []).append(((a - t0) * 1e3, (b - t0) * 1e3))
        lines.append(f"=== {'trainer' if rank == 0 else 'rollout'}: step, entered, left, took (ms from "
                     f"the trainer's start; medians of {len(updates)} updates)")
        for name, spans in rows.items():
            a = statistics.median(s[0] for s in spans)
            b = statistics.median(s[1] for s in spans)
            took = statistics.median(s[1] - s[0] for s in spans)
            lines.append(f"  {name:<18} {a:8.2f} {b:8.2f} {took:8.2f}  x{len(spans) // len(updates)}")
    return "\n".join(lines)


def worker(rank: int, backend: str, preset: str, layers: int | None, direct: bool, port: int,
           top: int, timeline: bool = False, phases: int = 0) -> str:
    trainer = rank == 0
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=120)
    shapes = presets.shapes(preset, layers)
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", rank if backend != "colocated" else 0) if gpu else torch.device("cpu")
    if trainer:
        weights = {n: torch.randn(s, dtype=torch.bfloat16, device=device) for n, s in shapes}
    else:
        weights = {n: torch.zeros(s, dtype=torch.bfloat16, device=device) for n, s in shapes}
    engine = CheckpointEngineRegistry.new(backend, role="trainer" if trainer else "rollout", timeout=120,
                                          device=device)
    if not trainer:
        if backend == "colocated":
            engine.set_destinations(weights, direct=direct)
        else:
            engine.set_destinations(weights)
    connect(engine, rdv, 1, 1)
    one = _update_fn(engine, ModuleSource(weights) if trainer else None, weights)  # (the bench's)

    def update() -> None:
        one()
        if gpu:
            torch.cuda.synchronize()

    for _ in range(2):
        rdv.all_gather(None)
        update()
    rdv.all_gather(None)
    if phases:
        marks: list[tuple[str, float, float]] = []
        _traced(engine, marks)
        updates = []
        for _ in range(phases):
            rdv.all_gather(None)
            marks.clear()
            t = time.perf_counter()
            update()
            marks.insert(0, ("update", t, time.perf_counter()))
            updates.append(list(marks))
        every = rdv.all_gather(updates)
        engine.finalize(destroy_group=True)
        return _phases_table(every) if trainer else ""
    if timeline and gpu:
        text = _timeline(update)
        engine.finalize(destroy_group=True)
        return f"=== {'trainer' if trainer else 'rollout'} (GPU timeline of one warm update)\n{text}"
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    update()
    prof.disable()
    took = time.perf_counter() - t0
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    engine.finalize(destroy_group=True)
    return f"=== {'trainer' if trainer else 'rollout'}: {took * 1e3:.1f} ms (profiled)\n" + out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="gloo")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--tensors", type=int, default=100000)
    ap.add_argument("--tensor-bytes", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--direct", action="store_true", help="colocated: direct mode (GPU)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--timeline", action="store_true", help="GPU: torch's profiler, not cProfile")
    ap.add_argument("--phases", type=int, default=0, metavar="N",
                    help="N warm updates with each engine step timed on both sides, not cProfile")
    a = ap.parse_args()
    preset = a.preset or presets.stress(a.tensors, a.tensor_bytes)
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = torch.distributed.TCPStore("127.0.0.1", port, None, True, wait_for_workers=False)
    args = (a.backend, preset, a.layers, a.direct, port, a.top, a.timeline, a.phases)
    for text in spawn(worker, 2, args, timeout=600):
        if text:
            print(text)
    del store


if __name__ == "__main__":
    main()
