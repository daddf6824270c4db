"""`weightbus bench` on the CPU: every scenario runs, measures its floor in the same run,
and verifies the rollout's tensors against the trainer's."""

import pytest

from weightbus.tools.bench import BenchConfig, format_table, run_bench


@pytest.mark.parametrize("scenario", ["colocated", "disaggregated", "hybrid-fsdp"])
def test_bench_scenario_cpu(scenario):
    row = run_bench(BenchConfig(scenario=scenario, preset="tiny", iters=2, gpu=False, timeout=120))
    assert row["verified"]
    assert row["floor_s"] > 0 and row["weightbus_s"] > 0
    assert len(row["all_times"]["weightbus"]) == 2
    assert (row["naive_s"] is not None) == (scenario != "hybrid-fsdp")
    assert scenario in format_table([row])


def test_bench_fp8_colocated_row_cpu():
    """``fp8``: the rollout serves its linear weights in block fp8 and is checked bitwise
    against torch's quantizer run on the trainer's weights; the bytes are what it holds."""
    row = run_bench(BenchConfig(scenario="colocated", preset="tiny", iters=1, gpu=False, timeout=120,
                                trainer_dtype="bf16", fp8=True))
    assert row["verified"] and row["scenario"] == "colocated fp8" and row["naive_s"] is None
    from weightbus.planning import presets
    from weightbus.planning.simulate import served_fp8
    held = sum(r * c + 4 * -(-r // 128) * -(-c // 128) if served_fp8(n, s) else 2 * r * c
               for n, s in presets.shapes("tiny") for r, c in [(s[0], s[1] if len(s) > 1 else 1)])
    assert row["bytes"] == held
    with pytest.raises(ValueError, match="fp8= applies to the colocated scenarios"):
        BenchConfig(scenario="disaggregated", preset="tiny", gpu=False, fp8=True)


def test_bench_stress_preset_and_checks_before_running(tmp_path):
    """A many-tensor stress preset runs and verifies; bad names fail at once, naming the
    choices; the plot is drawn."""
    from weightbus.planning import presets
    from weightbus.tools.bench import main_bench

    lines = []
    cfg = BenchConfig(scenario="disaggregated", preset=presets.stress(2000, 64), iters=1, gpu=False,
                      timeout=120, trainer_dtype="bf16")
    assert main_bench([cfg], plot_path=str(tmp_path / "p.svg"), log=lines.append) == 0
    assert any("running" in x for x in lines) and "<svg" in (tmp_path / "p.svg").read_text()
    for bad, named in ((dict(preset="7b"), "unknown preset '7b'.*30b-a3b"),
                       (dict(scenario="colocted"), "unknown scenario"),
                       (dict(trainer_dtype="fp8"), "trainer_dtype"),
                       (dict(preset="tiny", layers=0), "--layers 0")):
        with pytest.raises(ValueError, match=named):
            BenchConfig(**{"scenario": "disaggregated", "preset": "tiny", "gpu": False} | bad)


def test_bench_backends_and_receivers_cpu():
    """The disaggregated scenario over a chosen engine and several receivers: each row next
    to its own engine's raw transfer, every receiver verified."""
    nixl = pytest.importorskip("nixl")
    mooncake = pytest.importorskip("mooncake.engine")
    assert nixl and mooncake
    for backend in ("gloo", "nixl", "mooncake"):
        row = run_bench(BenchConfig(scenario="disaggregated", preset="tiny", iters=1, gpu=False, timeout=120,
                                    backend=backend, receivers=2))
        assert row["verified"] and row["scenario"] == f"disagg {backend} 1->2"
        assert (row["naive_s"] is not None) == (backend == "gloo")
    with pytest.raises(ValueError, match="backend= applies to the disaggregated scenario only"):
        BenchConfig(scenario="colocated", preset="tiny", gpu=False, backend="nixl")
    with pytest.raises(ValueError, match="receivers must be an int >= 1"):
        BenchConfig(scenario="disaggregated", preset="tiny", gpu=False, receivers=0)


def test_bench_delta_row_cpu():
    """``--delta``: a delta-mode engine timed next to the dense one in the same run, both
    rollouts verified, its wire bytes a small share of the dense ones at 2 % changed."""
    row = run_bench(BenchConfig(scenario="disaggregated", preset="tiny", iters=2, gpu=False, timeout=120,
                                delta=0.02))
    assert row["verified"] and row["delta_s"] > 0 and not row["delta_full"]
    assert row["delta_wire_fraction"] < 0.15
    assert "delta 2.0% changed" in format_table([row])


def test_bench_sharded_row_cpu():
    """``--rollout-tp 2``: a sharded update to the two TP ranks of a replica, timed next to
    the broadcast row, every rank verified against its rows, each receiving only its share."""
    row = run_bench(BenchConfig(scenario="disaggregated", preset="tiny", iters=1, gpu=False, timeout=120,
                                rollout_tp=2))
    assert row["verified"] and row["scenario"] == "disagg gloo 1->2 TP" and row["sharded_s"] > 0
    assert all(b < 0.6 * row["bytes"] for b in row["shard_bytes"]), row["shard_bytes"]
    assert row["sharded_floor_s"] > 0 and row["sharded_ratio"] == row["sharded_s"] / row["sharded_floor_s"]
    assert "sharded TP=2" in format_table([row]) and "floor" in format_table([row])
    with pytest.raises(ValueError, match="rollout_tp= applies to the disaggregated scenario"):
        BenchConfig(scenario="colocated", preset="tiny", gpu=False, rollout_tp=2)
    with pytest.raises(ValueError, match="rollout_tp must be an int >= 1"):
        BenchConfig(scenario="disaggregated", preset="tiny", gpu=False, rollout_tp=0)
    with pytest.raises(ValueError, match="receivers=3 disagrees"):
        BenchConfig(scenario="disaggregated", preset="tiny", gpu=False, rollout_tp=2, receivers=3)


def test_bench_fsdp_trainers_sharded_row_cpu():
    """``--trainers 2 --rollout-tp 2 --delta 0.02``: two FSDP2 trainer ranks, each holding
    half of every tensor, both send (the sharded update's buckets spread over them), and
    every TP rank gets exactly its rows, bitwise, of weights that change every round; the
    delta columns from the same DTensors (each rank diffs its own rows), bitwise too."""
    row = run_bench(BenchConfig(scenario="disaggregated", preset="tiny", iters=2, gpu=False, timeout=120,
                                rollout_tp=2, trainers=2, delta=0.02))
    assert row["verified"] and row["scenario"] == "disagg gloo 2->2 TP" and row["trainers"] == 2
    assert row["delta_s"] > 0 and not row["delta_full"] and row["delta_wire_fraction"] < 0.15
    assert row["sharded_delta_s"] > 0 and not row["sharded_delta_full"]
    sent = row["shard_sent"]
    assert len(sent) == 2 and min(sent) > 0.3 * sum(sent), sent  # both trainers send their share
    assert sum(sent) >= sum(row["shard_bytes"])
    assert row["sharded_floor_s"] > 0 and "sharded TP=2" in format_table([row])
    with pytest.raises(ValueError, match="trainers= applies to the disaggregated scenario"):
        BenchConfig(scenario="colocated", preset="tiny", gpu=False, trainers=2)
    with pytest.raises(ValueError, match="trainers= applies to the disaggregated scenario"):
        BenchConfig(scenario="disaggregated", preset="tiny", gpu=False, trainers=2, backend="nixl")
    with pytest.raises(ValueError, match="trainers must be an int >= 1"):
        BenchConfig(scenario="disaggregated", preset="tiny", gpu=False, trainers=0)


def test_bench_relayed_row_cpu():
    """``--rollout-tp 1 --replicas 3 --relay 1``: the update to 3 single-rank replicas timed
    broadcast, sharded direct and relayed, each with its floor (the trainer's bytes sent
    point to point), every rank verified each way, the relaying trainer sending a third."""
    row = run_bench(BenchConfig(scenario="disaggregated", preset="tiny", iters=1, gpu=False, timeout=120,
                                rollout_tp=1, replicas=3, relay=1))
    assert row["verified"] and row["scenario"] == "disagg gloo 1->3 TPx3" and row["relayed_s"] > 0
    assert row["shard_bytes"] == [row["bytes"]] * 3  # (TP=1: each replica holds the whole model)
    assert row["relay_sent_fraction"] == pytest.approx(1 / 3, abs=0.01)
    assert row["relayed_floor_s"] > 0 and row["sharded_floor_s"] > 0
    text = format_table([row])
    assert "relayed relay=1" in text and "sharded TP=1 x3" in text and "target" not in text
    with pytest.raises(ValueError, match="replicas= and relay= apply to sharded rows"):
        BenchConfig(scenario="disaggregated", preset="tiny", gpu=False, relay=1)
    with pytest.raises(ValueError, match="relay must be an int >= 1"):
        BenchConfig(scenario="disaggregated", preset="tiny", gpu=False, rollout_tp=2, relay=0)
