"""Careless use fails fast and names the fix (issue: the first hour of a new user)."""

import subprocess
import sys
import time

import pytest
import torch
from mgr_workers import Rollout

from weightbus import ModuleSink, ModuleSource, PlanError, SinkError, UpdateStats, WeightSource
from weightbus.errors import WeightbusError
from weightbus.manager import CheckpointEngineManager
from weightbus.runtime.group import LocalWorkerGroup


def test_replicas_of_one_class_get_names_that_never_collide():
    a, b = LocalWorkerGroup(Rollout, 1), LocalWorkerGroup(Rollout, 1)
    trainer = LocalWorkerGroup(Rollout, 1, name="not-a-trainer")  # membership only: no update
    try:
        assert a.name != b.name
        mgr = CheckpointEngineManager("gloo", trainer, [a, b])
        with pytest.raises(WeightbusError, match=f"already named {b.name!r}.*own name="):
            mgr.add_replicas([_named(b.name)])
        mgr.remove_replicas([b.name])
        assert [r.name for r in mgr.replicas] == [a.name]  # the right one went
        with pytest.raises(WeightbusError, match=rf"no replica 'ghost' among \['{a.name}'\]"):
            mgr.remove_replicas(["ghost"])
    finally:
        for g in (a, b, trainer):
            g.shutdown(timeout=2)


class _named:
    """A second group that happens to carry an existing name (as two explicit name= can)."""

    def __init__(self, name):
        self.name, self.size = name, 1


def test_a_dtype_mismatch_is_reported_once_with_the_fix():
    model = torch.nn.Linear(4, 3)  # fp32
    stream = [(n, t.to(torch.bfloat16)) for n, t in model.state_dict().items()]
    with pytest.raises(SinkError) as err:
        ModuleSink(model).load_iter(stream)
    text = str(err.value)
    assert "mismatched: weight (got torch.bfloat16, model has torch.float32)" in text
    assert "missing" not in text  # it arrived: mismatched, not also missing
    assert "allow_cast=True" in text
    report = ModuleSink(model, allow_cast=True).load_iter(stream)
    assert report.ok and report.to_dict()["loaded"] == 2


def test_sources_refuse_non_tensors_naming_them():
    with pytest.raises(PlanError, match="'step' is of type int, not a tensor"):
        ModuleSource({"w": torch.ones(2), "step": 3})
    with pytest.raises(PlanError, match="name_map.*must return"):
        ModuleSource({"w": torch.ones(2)}, name_map=lambda n: 7)
    assert isinstance(ModuleSource({"w": torch.ones(2)}), WeightSource)
    stats = UpdateStats(1, 2, 10, 20, 0.5, 1)
    assert stats.to_dict()["gbps"] == pytest.approx(2e-8)


def _cli(*args):
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "weightbus.tools.cli", *args], capture_output=True, text=True,
                         timeout=60)
    return out.returncode, out.stdout + out.stderr, time.monotonic() - t0


def test_cli_checks_arguments_before_anything_starts():
    rc, text, took = _cli("demo", "--backend", "glo")
    assert rc == 2 and "invalid choice: 'glo'" in text and "gloo" in text and took < 20
    rc, text, took = _cli("bench", "--preset", "7b")
    assert rc == 2 and "invalid choice: '7b'" in text and "30b-a3b" in text and took < 20
    rc, text, _ = _cli("bench", "--tensors", "10", "--tensor-bytes", "3")
    assert rc == 2 and "even tensor size" in text
    rc, text, _ = _cli("--version")
    assert rc == 0 and text.startswith("weightbus ")
    rc, text, _ = _cli("bench", "--help")
    assert rc == 0 and "(default: 5)" in text and "Layer" not in text


def test_bench_prints_progress_and_no_warnings():
    rc, text, _ = _cli("bench", "--scenario", "hybrid-fsdp", "--iters", "1")
    assert rc == 0, text
    assert "[1/1] hybrid-fsdp tiny (fp32 trainer): running" in text and "OK" in text
    assert "Warning" not in text
    lines = text.splitlines()
    first_row = next(i for i, line in enumerate(lines) if line.startswith("hybrid-fsdp "))
    assert lines[first_row - 1].startswith("scenario "), text  # (a row never comes before its header)


def test_join_fails_fast_naming_the_address_when_nothing_answers():
    from weightbus import CheckpointEngineRegistry, WeightSyncError
    from weightbus.comm import free_port
    from weightbus.runtime.local import join

    port = free_port()  # nothing serves it
    engine = CheckpointEngineRegistry.new("gloo", role="rollout", timeout=3)
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError, match=rf"rank 1 \(rollout\): cannot reach the rendezvous store at "
                                              rf"127.0.0.1:{port} within 3s"):
        join(engine, rank=1, trainer_world_size=1, rollout_world_size=1, master_addr="127.0.0.1",
             master_port=port)
    assert time.monotonic() - t0 < 10
    with pytest.raises(WeightbusError, match="rank 5 is outside"):
        join(engine, rank=5, trainer_world_size=1, rollout_world_size=1, master_addr="127.0.0.1",
             master_port=port)


def test_progress_callback_on_both_sides(port):
    import workers

    from weightbus.runtime.local import spawn

    (sent, ok0), (got, ok1) = spawn(workers.progress_reported, 2, (port,), timeout=120)
    total = sent[-1][1]
    assert total > 3 and sent == [(i, total) for i in range(1, total + 1)] == got
    assert "ok" in ok0 and "ok" in ok1  # a raising callback is logged, not fatal


def test_demo_says_why_it_is_far_from_its_floor():
    rc, text, _ = _cli("demo", "--steps", "1", "--dim", "64", "--layers", "1", "--trainers", "1",
                       "--rollouts", "1")
    assert rc == 0 and "bitwise OK" in text
    assert "Why the ratio is far from 1 here" in text and "benchmarks/RESULTS.md" in text


def test_the_demo_footer_speaks_of_the_backend_it_ran():
    from weightbus.tools.demo import at_scale_note
    notes = {b: at_scale_note(b) for b in ("nccl", "colocated", "nixl", "mooncake", "shm")}
    assert len(set(notes.values())) == len(notes), notes
    assert "broadcast" in notes["nccl"] and "bulk copy" in notes["colocated"]


def test_the_demo_tells_each_step_as_it_happens():
    from weightbus.tools.demo import DemoConfig, run_demo
    said = []
    rows = run_demo(DemoConfig(trainers=1, rollouts=1, steps=2, dim=64, layers=1, vocab=256), said.append)
    assert [r["verified"] for r in rows] == [True, True]
    assert said[0] == "starting 2 processes" and said[1].startswith("group formed")
    assert [s.split(":")[0] for s in said if s.startswith("update")] == ["update 1/2", "update 2/2"]
    assert said[-1].startswith("measuring the floor")
