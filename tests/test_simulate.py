"""The planner's simulator (weightbus.planning.simulate) against what we measured, and its schedule
against the engines' own plans.

The calibration rows are benchmarks/RESULTS.md's GPU rows of the code that runs today, each
named by its section; the simulator must land within 15% of every one."""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time

import pytest
import torch

from weightbus.errors import PlanError
from weightbus.plan import BucketPlan
from weightbus.planning import presets
from weightbus.planning.cluster import Layout, cluster, model_shapes
from weightbus.planning.simulate import Shards, manifest_of, plan, quantize_s, simulate

FP32, BF16 = torch.float32, torch.bfloat16
GiB = 1 << 30

# (RESULTS.md row, preset, layers, layout, backend, trainer dtype, delta, measured ms: every
# run's median of its timed updates). "plan" rows: `bash benchmarks/plan_calibrate.sh` on
# 2xH200 at 56e53a4 (the planner section of RESULTS.md), the last runs on a warm machine;
# "issue 31" rows: the hot-path section, one H200; "round eight" and "round nine" rows: one
# H200, the code that runs today (RESULTS, "At the link, round eight" and "round nine"). The
# ring's rows predate its events (round four: 30b-a3b/24 now takes ~40 ms, not 60-69): its
# constants wait for 2-GPU rows. Delta rows (delta: a fraction, or (fraction, verify_every)):
# 8b end to end on 2xH200 (RESULTS, "Delta, round eleven": this code, its warm-up no longer
# timed; with the check off, "round ten": 78094ab and 764746d's day); the rows with the check at
# the update's end (43.8-67.7 ms) measured code that no longer runs. 30b-a3b/24's delta end to
# end (56-106 ms over runs and settings) is not held: the model has no term for the rounds'
# waits on each other, which its many tensors show.
D, C, H = Layout(1, 1), Layout(1, 1, colocated=True), Layout(2, 2, colocated=True)
ROWS = [
    ("plan d06: disaggregated 0.6b bf16", "0.6b", None, D, "nccl", BF16, None, (6.9, 6.5, 6.3)),
    ("plan d8: disaggregated 8b bf16", "8b", None, D, "nccl", BF16, None, (48.9, 50.0)),
    ("plan d8f: disaggregated 8b fp32", "8b", None, D, "nccl", FP32, None, (51.0, 50.4)),
    ("delta end to end, 2xH200: 8b bf16 at 2%", "8b", None, D, "nccl", BF16, 0.02,
     (36.3, 33.0, 38.5, 38.5, 39.9, 40.2, 40.0, 30.3, 42.0)),
    ("delta end to end, 2xH200: 8b bf16 at 2%, check off", "8b", None, D, "nccl", BF16, (0.02, 0),
     (29.8, 45.7)),
    ("plan d30: disaggregated 30b-a3b bf16", "30b-a3b", None, D, "nccl", BF16, None, (182.1, 177.5)),
    ("plan c8f: colocated ring 8b fp32", "8b", None, C, "colocated-ring", FP32, None, (35.7, 33.3)),
    ("plan cd8f: colocated-direct 8b fp32", "8b", None, C, "colocated", FP32, None, (15.2, 14.1)),
    ("plan c30: colocated ring 30b-a3b/24 bf16", "30b-a3b", 24, C, "colocated-ring", BF16, None,
     (69.3, 64.0)),
    ("plan h8: hybrid-fsdp (ring) 8b fp32", "8b", None, H, "colocated-ring", FP32, None, (109.9, 86.1, 89.8)),
    ("plan hd8: hybrid-fsdp-direct 8b fp32", "8b", None, H, "colocated", FP32, None, (47.5, 47.3)),
    ("plan hd30: hybrid-fsdp-direct 30b-a3b/12 fp32", "30b-a3b", 12, H, "colocated", FP32, None,
     (69.3, 55.6, 54.2)),
    ("round eight, H200: colocated-direct 30b-a3b/24 bf16", "30b-a3b", 24, C, "colocated", BF16, None,
     (18.8, 18.3, 18.8)),
    ("round nine: colocated-direct 30b-a3b/24 fp32", "30b-a3b", 24, C, "colocated", FP32, None,
     (26.1, 25.7, 26.0)),
    ("issue 31: colocated ring 30b-a3b/24 bf16", "30b-a3b", 24, C, "colocated-ring", BF16, None,
     (63.0, 60.6)),
]


# One trainer to the 3 TP ranks of one replica, on 4 H100s (`bash benchmarks/plan_calibrate.sh
# s8tp3 s30tp3`; the bench's layout: every matrix split by rows, vectors whole): the
# broadcast to all 3 and sharded receive, in one run. The sharded 30b-a3b rows are the
# code of this stop (`benchmarks/relay_gpu.sh s30tp3` and ab_hotpath.sh's s30 row, RESULTS
# "Relay of shards between replicas, 4 x H100"); the 8b ones at 56e53a4, where its few
# large pieces hide the per-piece cost behind the link all the same.
TP3 = [
    ("plan s8tp3: nccl 1->3, 8b bf16", "8b", None, "nccl", (54.8, 54.7)),
    ("plan s8tp3: sharded TP=3, 8b bf16", "8b", None, "sharded", (50.5, 50.0)),
    ("plan s30tp3: nccl 1->3, 30b-a3b/24 bf16", "30b-a3b", 24, "nccl",
     (103.5, 107.7, 97.5, 103.7, 108.0, 96.7)),
    ("plan s30tp3: sharded TP=3, 30b-a3b/24 bf16 (28,305 pieces)", "30b-a3b", 24, "sharded",
     (99.6, 97.9, 99.1)),
]


@pytest.mark.parametrize("row", TP3, ids=[r[0] for r in TP3])
def test_one_sender_to_three_tp_ranks_within_15_percent(row):
    from weightbus.packing.shards import ShardLayout
    from weightbus.tools.bench import _tp_box
    _, preset, layers, backend, runs = row
    manifest = manifest_of(presets.shapes(preset, layers))
    layouts = [ShardLayout({m.name: [_tp_box(m.shape, r, 3)] for m in manifest.metas}) for r in range(3)]
    p = simulate(cluster("h100"), Layout(1, 1, 3), manifest, backend, shards=Shards(manifest, 3, layouts))
    ms = statistics.median(runs)
    assert abs(p.seconds * 1e3 / ms - 1) <= 0.15, (p.seconds * 1e3, ms, p.parts)


# One trainer GPU to 1-3 replicas of one GPU each, on 4 H100s (`bash benchmarks/relay_gpu.sh`,
# RESULTS "Relay of shards between replicas, 4 x H100"; 1 GiB buckets): the sharded update fed
# by the trainer (direct) and relayed between the replicas, each run's timed updates.
RELAY = [
    ("relay r8x2: direct, 8b x2", "8b", None, 2, "sharded", None, (95.9, 100.9, 95.5)),
    ("relay r8x2: chain, 8b x2", "8b", None, 2, "sharded-relay", 1, (56.3, 57.7, 55.5)),
    ("relay r8x3: direct, 8b x3", "8b", None, 3, "sharded", None, (151.4, 142.4, 142.1)),
    ("relay r8x3: chain, 8b x3", "8b", None, 3, "sharded-relay", 1, (59.8, 59.2, 59.2)),
    ("relay r8x3t: 2-ary tree, 8b x3", "8b", None, 3, "sharded-relay", 2, (99.7, 101.2, 99.6)),
    ("relay r30x3: direct, 30b-a3b/12 x3", "30b-a3b", 12, 3, "sharded", None, (146.6, 146.8, 147.4)),
    ("relay r30x3: chain, 30b-a3b/12 x3", "30b-a3b", 12, 3, "sharded-relay", 1, (62.4, 62.1, 61.9)),
]


@pytest.mark.parametrize("row", RELAY, ids=[r[0] for r in RELAY])
def test_relay_rows_within_15_percent(row):
    _, preset, layers, replicas, backend, k, runs = row
    manifest = manifest_of(presets.shapes(preset, layers))
    p = simulate(cluster("h100"), Layout(1, replicas, 1), manifest, backend, bucket_size=GiB, relay=k)
    ms = statistics.median(runs)
    assert abs(p.seconds * 1e3 / ms - 1) <= 0.15, (p.seconds * 1e3, ms, p.parts)
    assert p.floor_s <= p.seconds


def test_relay_table_and_its_plot_from_the_measured_files():
    """benchmarks/relay_table.py over the committed 4-GPU rows: a line per update with its
    floor and the planner's prediction, and the fan-out curve with every series."""
    import glob
    import json
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = sorted(glob.glob(os.path.join(root, "benchmarks", "results", "relay_h100x4_r8x*.json")))
    assert len(files) == 4
    out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "relay_table.py"), *files],
                         capture_output=True, text=True, check=True, cwd=root).stdout
    rows = [json.load(open(f))[0] for f in files]
    assert out.count("| sharded, direct |") == len(rows) and "relay=2 (2-ary tree)" in out
    sys.path.insert(0, os.path.join(root, "benchmarks"))
    try:
        import relay_table
    finally:
        sys.path.pop(0)
    svg = relay_table.plot(rows, [relay_table.predictions(r, "h100") for r in rows])
    for name in ("broadcast", "direct", "relay=1", "relay=1, planner", "relay=1 floor"):
        assert f">{name}</text>" in svg, name
    assert svg.count("<polyline") == 9  # 3 updates x (measured, planned, floor)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_simulator_within_15_percent_of_every_measured_row(row):
    _, preset, layers, layout, backend, dtype, delta, runs = row
    delta, every = delta if isinstance(delta, tuple) else (delta, 1)
    p = simulate(cluster("h200x2"), layout, manifest_of(presets.shapes(preset, layers)), backend,
                 trainer_dtype=dtype, delta=delta, verify_every=every)
    ms = statistics.median(runs)
    assert abs(p.seconds * 1e3 / ms - 1) <= 0.15, (p.seconds * 1e3, ms, p.parts)
    assert p.floor_s <= p.seconds or delta is not None


def test_fp8_into_a_colocated_rollout_within_15_percent():
    """RESULTS, "At the link, round seven" (one H200): a bf16 trainer's update into a
    colocated rollout serving block fp8, direct mode, the quantizer writing the rollout's
    payloads itself: no fp8 copy of the model planned, nor its memory."""
    manifest = manifest_of(presets.shapes("30b-a3b", 24), fp8=True)
    p = simulate(cluster("h200"), C, manifest, "colocated", trainer_dtype=BF16, fp8=True)
    runs = (18.1, 17.5, 16.9, 18.2, 18.6, 17.3, 18.9, 20.0, 19.0)
    assert abs(p.seconds * 1e3 / statistics.median(runs) - 1) <= 0.15, (p.seconds * 1e3, p.parts)
    assert p.peak_extra_gib == 0
    # the ring (and an fp32 trainer, cast first) still quantize into an fp8 copy, then copy it
    ring = simulate(cluster("h200"), C, manifest, "colocated-ring", trainer_dtype=BF16, fp8=True)
    fp32 = simulate(cluster("h200"), C, manifest, "colocated", trainer_dtype=FP32, fp8=True)
    payloads = sum(m.nbytes for m in manifest.metas if m.dtype.itemsize == 1) / GiB
    assert ring.peak_extra_gib >= payloads and fp32.peak_extra_gib >= payloads
    assert fp32.seconds > p.seconds + 5e-3


@pytest.mark.parametrize("preset, layers, ms", [("8b", None, 44.9), ("30b-a3b", 12, 244.1)])
def test_a_gather_per_tensor_within_15_percent_of_the_measured_rows(preset, layers, ms):
    """benchmarks/gather_each.py on 2xH200: every tensor cast and all-gathered on its own
    (the hybrid ring's gathers); many small tensors pay per call, not per byte."""
    from weightbus.planning.simulate import CALIBRATION, gather_each_s
    manifest = manifest_of(presets.shapes(preset, layers))
    c = cluster("h200x2")
    cast = manifest.nbytes / 2 * 3 / (c.hbm_gbps * 1e9 * CALIBRATION.hbm_eff)  # (fp32 shard -> bf16)
    got = (gather_each_s(manifest, 2, c.nvlink_gbps * 1e9 * CALIBRATION.allgather_eff) + cast) * 1e3
    assert abs(got / ms - 1) <= 0.15, (got, ms)


@pytest.mark.parametrize("preset, layers, ms", [("30b-a3b", 24, 15.9), ("8b", None, 5.7)])
def test_quantization_within_15_percent_of_the_fp8_rows(preset, layers, ms):
    """issue 35's rows: quantize_many over a preset's served weights on one H200."""
    got = quantize_s(manifest_of(presets.shapes(preset, layers), fp8=True), cluster("h200")) * 1e3
    assert abs(got / ms - 1) <= 0.15, (got, ms)


def test_delta_bytes_by_the_engines_rule_match_the_measured_share():
    """Delta updates (README, "Delta updates", CPU): at 2% of the elements changed the wire
    carried 5.9% of the dense bytes; the planner sizes the records by the engine's rule."""
    from weightbus.planning.simulate import delta_share
    share = delta_share(manifest_of(presets.shapes("0.6b")), 0.02, 2)
    assert abs(share / 0.059 - 1) <= 0.15, share
    c, lay, manifest = cluster("h100", 2), Layout(8, 1, 8), manifest_of(presets.shapes("8b"))
    dense = simulate(c, lay, manifest, "nccl")
    delta = simulate(c, lay, manifest, "nccl", delta=0.02)
    assert delta.parts["links"] < 0.1 * dense.parts["links"] and "diff" in delta.parts


def test_the_schedule_is_the_engines_plan():
    """What the simulator puts on the links is what BucketPlan and ShardPlan assign."""
    c = cluster("h100", 4)
    manifest = manifest_of(presets.shapes("8b"))
    lay = Layout(8, 2, 8)
    bcast = simulate(c, lay, manifest, "nccl", bucket_size=GiB)
    assert bcast.buckets == len(BucketPlan(manifest, GiB, 8))
    assert bcast.rollout_gb == pytest.approx(manifest.nbytes / 1e9)  # (every rank: the whole model)
    sharded = simulate(c, lay, manifest, "sharded", bucket_size=GiB)
    shards = Shards(manifest, 8)
    assert sharded.rollout_gb == pytest.approx(max(shards.bytes) / 1e9)
    # a replica's ranks hold the model between them (vectors kept by every rank on top)
    assert manifest.nbytes <= sum(shards.bytes) < manifest.nbytes * 1.01
    assert sharded.seconds < bcast.seconds


def test_megatron_buckets_leave_from_where_their_tensors_are():
    """Under Megatron (tp 2, pp 2, ep 4) the plan is BucketPlan's home-aware packing: each
    bucket is packed by a rank of the stage (and expert rank) holding all of its tensors,
    and a packer gathers its TP pieces over NVLink."""
    from weightbus.planning.simulate import megatron_homes
    manifest = manifest_of(presets.shapes("30b-a3b", 4))
    lay = Layout(32, 1, 8, tp=2, pp=2, ep=4)
    homed = megatron_homes(manifest, lay)
    plan_ = BucketPlan(homed, 256 << 20, lay.n_senders)
    for b in plan_.buckets:
        for ch in b.chunks:
            assert b.owner in homed.homes[ch.index], (manifest[ch.index].name, b.owner)
    stage = {s: s // (lay.ep * lay.tp) for s in range(lay.n_senders)}
    first = [manifest[c.index].name for b in plan_.buckets if stage[b.owner] == 0 for c in b.chunks]
    assert first and all(".layers.0." in n or ".layers.1." in n or "embed" in n for n in first)
    p = simulate(cluster("h100", 8), lay, manifest, "nccl", bucket_size=256 << 20)
    assert p.nvlink_gb > 0  # (the TP gathers)
    with pytest.raises(PlanError, match="no whole number of Megatron replicas"):
        Layout(30, 1, 8, tp=2, pp=2, ep=4)


def test_more_bandwidth_is_never_slower_and_the_floor_holds():
    manifest = manifest_of(presets.shapes("30b-a3b"))
    lay = Layout(16, 4, 4)
    slow = cluster("h100", 4)
    fast = dataclasses.replace(slow, nic_gbps=100)
    for backend in ("nccl", "nixl", "sharded"):
        a, b = simulate(slow, lay, manifest, backend), simulate(fast, lay, manifest, backend)
        assert b.seconds <= a.seconds and a.floor_s <= a.seconds and b.floor_s <= b.seconds, backend


def test_one_trillion_parameters_256_to_128_gpus_within_1_2x_of_the_nic_floor():
    """The issue's target: Kimi-K2 (1.04T parameters) from 256 bf16 trainer GPUs to 128 fp8
    rollout GPUs (8 replicas x 16, expert parallel) on H100 nodes."""
    manifest = manifest_of(model_shapes("kimi-k2"), fp8=True)
    best = plan(cluster("h100", 48), Layout(256, 8, 16), manifest, fp8=True)[0]
    assert best.backend == "sharded" and best.bottleneck.startswith("nic")
    assert best.seconds <= 1.2 * best.floor_s, (best.seconds, best.floor_s, best.parts)


def test_layouts_that_do_not_fit_fail_where_given():
    with pytest.raises(PlanError, match=r"needs 24 GPUs .* the cluster has 16"):
        simulate(cluster("h100", 2), Layout(8, 2, 8), manifest_of(presets.shapes("tiny")), "nccl")
    with pytest.raises(PlanError, match="needs the rollouts on the trainers' GPUs"):
        simulate(cluster("h100", 2), Layout(8, 1, 8), manifest_of(presets.shapes("tiny")), "colocated")
    with pytest.raises(PlanError, match="senders must be in"):
        Layout(8, 1, 8, senders=9)
    small = dataclasses.replace(cluster("h100", 1), host_mem_gib=16)
    with pytest.raises(PlanError, match=r"shm keeps 2 versions of 15 GiB in host memory; a node has 16 GiB"):
        simulate(small, Layout(4, 2, 2), manifest_of(presets.shapes("8b")), "shm")
    with pytest.raises(PlanError, match="the rollouts must sit on the node of trainer rank 0"):
        simulate(cluster("h100", 2), Layout(8, 1, 8), manifest_of(presets.shapes("tiny")), "shm")
    one_node = plan(cluster("h100", 1), Layout(4, 2, 2), manifest_of(presets.shapes("tiny")))
    assert "shm" in [p.backend for p in one_node]
    with pytest.raises(PlanError, match="unknown cluster 'a100'"):
        cluster("a100")
    with pytest.raises(PlanError, match="no preset .* no known model .* no config.json"):
        model_shapes("/nonexistent/model")


def test_plan_cli_prints_the_table_and_the_sweep_in_seconds(tmp_path):
    svg = tmp_path / "sweep.svg"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "weightbus", "plan", "--cluster", "h100", "--nodes", "4", "--model",
           "30b-a3b", "--trainers", "16", "--replicas", "2", "--rollout-gpus", "8", "--sweep", "1,2,4",
           "--plot", str(svg)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - t0 < 60
    assert "recommended: sharded" in out.stdout and "floor s" in out.stdout, out.stdout
    assert out.stdout.count("sharded") >= 2 and "replicas" in out.stdout
    assert svg.read_text().startswith("<svg")
    bad = subprocess.run([sys.executable, "-m", "weightbus", "plan", "--cluster", "h100", "--nodes", "1",
                          "--model", "8b", "--trainers", "8", "--replicas", "1", "--rollout-gpus", "8"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "needs 16 GPUs" in bad.stderr and len(bad.stderr.splitlines()) == 1


def test_what_moves_per_rank_and_per_link_adds_up():
    """The per-rank and per-link bytes a prediction reports (``--json``) are the schedule's:
    every byte a sender sends arrives, and what leaves NICs enters NICs."""
    c, manifest = cluster("h100", 4), manifest_of(presets.shapes("30b-a3b", 4))
    lay = Layout(8, 3, 4)
    gb = manifest.nbytes / 1e9
    for backend in ("nccl", "nixl", "mooncake", "sharded"):
        p = simulate(c, lay, manifest, backend, bucket_size=256 << 20)
        assert len(p.sent_gb) == lay.n_senders and len(p.received_gb) == lay.rollouts
        nic_out = sum(v for k, v in p.link_gb.items() if k.startswith("nic out"))
        nic_in = sum(v for k, v in p.link_gb.items() if k.startswith("nic in"))
        assert nic_out == pytest.approx(nic_in), backend
        if backend == "sharded":  # each replica's ranks hold the model between them, once
            assert sum(p.sent_gb) == pytest.approx(sum(p.received_gb))
            assert gb <= sum(p.received_gb[:4]) < gb * 1.01
        else:  # every rollout GPU receives the whole model; the senders split it
            assert sum(p.sent_gb) == pytest.approx(gb) and p.received_gb == pytest.approx([gb] * 12)
        if backend == "mooncake":  # each sender's share once per replica, to the replica's leader
            assert nic_out == pytest.approx(3 * gb)
            assert p.link_gb[f"pcie in of GPU {lay.rollout_gpu(0)}"] == pytest.approx(gb)


def test_delta_is_planned_where_the_engines_send_it():
    c, lay, manifest = cluster("h100", 2), Layout(8, 1, 8), manifest_of(presets.shapes("8b"))
    assert {p.backend for p in plan(c, lay, manifest, delta=0.02)} == {"nccl", "nixl", "mooncake", "sharded"}
    # delta on sharded receive (issue 54): each rank gets its shard's changes, a few percent
    # of its dense bytes; the same diff on the sender, the patches of its shard on each rank
    dense, changes = simulate(c, lay, manifest, "sharded"), simulate(c, lay, manifest, "sharded", delta=0.02)
    assert 0.03 < max(changes.received_gb) / max(dense.received_gb) < 0.1
    assert changes.seconds < 0.5 * dense.seconds and "diff" in changes.parts
    assert any("views (fixed placements)" in n for n in changes.notes)
    with pytest.raises(PlanError, match="not colocated"):
        simulate(c, Layout(8, 1, 8, colocated=True), manifest, "colocated", delta=0.02)
    checked = simulate(c, lay, manifest, "nccl", delta=0.02)
    unchecked = simulate(c, lay, manifest, "nccl", delta=0.02, verify_every=0)
    assert "verify" in checked.parts and "verify" not in unchecked.parts
    more = simulate(c, lay, manifest, "nccl", delta=0.1)
    assert more.parts["apply"] > checked.parts["apply"] and more.parts["links"] > checked.parts["links"]


def test_plan_cli_writes_every_rank_and_link_as_json(tmp_path):
    import json
    out = tmp_path / "plan.json"
    got = subprocess.run([sys.executable, "-m", "weightbus", "plan", "--cluster", "h100", "--model", "8b",
                          "--trainers", "8", "--replicas", "2", "--rollout-gpus", "4", "--sweep", "1,2",
                          "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    doc = json.loads(out.read_text())
    best = doc["predictions"][0]
    assert doc["recommended"]["backend"] == best["backend"] == "sharded"
    assert doc["recommended"]["use"]["backend"] == "nccl"  # (what --backend and the API take)
    from weightbus.engines.api import CheckpointEngineRegistry
    from weightbus.planning.planner import USE
    for engine, _ in USE.values():
        CheckpointEngineRegistry.get(engine)
    assert len(best["sent_gb"]) == 8 and len(best["received_gb"]) == 8 and best["link_gb"]
    assert len(doc["layout"]["rollout_gpus_by_rank"]) == 8 and [r["replicas"] for r in doc["sweep"]] == [1, 2]


def test_plan_cli_prices_the_delta_check_every_n_updates(tmp_path):
    """The receivers' whole-destination check every N delta updates costs 1/N of what the
    trainers' diff does not hide per update (8 trainers' diffs of 2 GB each hide part of
    one rollout GPU's 16 GB read), and none with N=0 (priced in process); the command
    line's --verify-every
    writes the same into its JSON, and refuses it without --delta."""
    import json
    c, lay, manifest = cluster("h100", 2), Layout(8, 1, 1), manifest_of(presets.shapes("8b"))
    verify = [plan(c, lay, manifest, delta=0.02, verify_every=n)[0].parts.get("verify", 0.0)
              for n in (1, 4, 0)]
    assert verify[1] == pytest.approx(verify[0] / 4) and verify[2] == 0.0 < verify[1]
    wide = plan(c, Layout(8, 1, 8), manifest, delta=0.02)[0].parts  # (each GPU reads less than a diff takes)
    assert wide.get("verify", 0.0) == 0.0 and wide["diff"] > 0
    base = [sys.executable, "-m", "weightbus", "plan", "--cluster", "h100", "--model", "8b",
            "--trainers", "8", "--replicas", "1", "--rollout-gpus", "1", "--delta", "0.02"]
    out = tmp_path / "v4.json"
    got = subprocess.run([*base, "--verify-every", "4", "--json", str(out)], capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    doc = json.loads(out.read_text())
    assert doc["model"]["verify_every"] == 4
    assert doc["predictions"][0]["parts"]["verify"] == pytest.approx(verify[1])
    bad = subprocess.run(base[:-2] + ["--verify-every", "4"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "give --delta too" in bad.stderr


def test_sweep_plot_draws_every_backend_on_labelled_axes_at_true_positions():
    import re

    from weightbus.planning.cluster import Layout, cluster
    from weightbus.planning.planner import Question, sweep_all, sweep_svg
    q = Question(cluster("h100", 4), Layout(trainers=16, replicas=2, rollout_gpus=8), "30b-a3b")
    rows = sweep_all(q, [1, 2, 16])
    svg = sweep_svg(rows, "t")
    backends = {p.backend for _, preds in rows for p in preds}
    assert svg.count("<polyline") == len(backends) + 1  # (and the floor)
    for name in backends:
        assert f">{name}</text>" in svg
    assert "seconds per update" in svg and "rollout replicas" in svg
    tick = r'<text x="([\d.]+)" y="[\d.]+" text-anchor="middle">(?:1|2|16)<'
    xs = sorted({float(x) for x in re.findall(tick, svg)})
    assert len(xs) == 3 and abs((xs[2] - xs[1]) - 3 * (xs[1] - xs[0])) < 1.0  # log2: 1 -> 2 -> 16


def test_relay_is_planned_where_replicas_outnumber_the_senders():
    """Sharded receive sends each replica its shards from the trainers: 16 replicas of 4
    GPUs from 8 trainer GPUs load the trainers' NICs 16 times over. Relayed (the engines'
    ``relay=k``), the trainers feed one replica and each replica's ranks forward to the
    next: the planner recommends it, says which k, and the senders send a sixteenth."""
    c, manifest = cluster("h100", 9), manifest_of(presets.shapes("8b"))
    lay = Layout(8, 16, 4)
    preds = {p.backend: p for p in plan(c, lay, manifest)}
    best = min(preds.values(), key=lambda p: p.seconds)
    direct, relay = preds["sharded"], preds["sharded-relay"]
    assert best is relay and relay.seconds < direct.seconds / 3, (relay.seconds, direct.seconds)
    assert sum(relay.sent_gb) == pytest.approx(sum(direct.sent_gb) / 16)
    assert relay.received_gb == pytest.approx(direct.received_gb)  # every rank still holds its shard
    assert any(n.startswith("relay=") and "depth" in n for n in relay.notes), relay.notes
    assert "relay fill" in relay.parts and relay.floor_s == direct.floor_s
    # with fewer replicas than the senders can feed, relaying only adds its fill
    few = {p.backend: p for p in plan(c, Layout(8, 2, 4), manifest)}
    assert few["sharded"].seconds <= few["sharded-relay"].seconds
    from weightbus.planning.planner import use
    assert use("sharded-relay")[0] == "nccl" and "relay=" in use("sharded-relay")[1]
    # one replica: nothing to relay to
    assert "sharded-relay" not in {p.backend for p in plan(c, Layout(8, 1, 4), manifest)}
