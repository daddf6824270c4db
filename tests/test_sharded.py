"""Sharded receive over gloo, across real processes: 1, 2 and 3 trainer ranks to a
tensor-parallel rollout of 2 ranks. Every rank keeps only its regions (bitwise equal to
the trainer's slices, after several updates with changing weights), written straight into
its parameters; the bytes each rank received (the engine's own counter) are its shard's,
not the model's; a tensor its layout does not name arrives whole and is counted."""

import pytest
import torch
import workers_shards as ws

from weightbus.packing.shards import ShardPlan
from weightbus.plan import Manifest, TensorMeta
from weightbus.runtime.local import spawn

R = 2


def _model_bytes():
    return sum(t.numel() * t.element_size() for t in ws.weights(1).values())


def _shard_bytes(r):
    want = ws.expected(1, r, R)
    return sum(t.numel() * 4 for t in want.values()) + 5 * 4  # + rotary.inv_freq, whole


@pytest.mark.parametrize("T", [1, 2, 3])
def test_each_rollout_rank_receives_only_its_shard(port, T):
    out = spawn(ws.run, T + R, (T, R, port, 3, 4096), timeout=240)
    for r in range(R):
        got = out[T + r]
        assert got["wrong"] == [], got["wrong"]
        assert got["whole"] == ["rotary.inv_freq"]  # the one tensor its layout leaves out
        for s in got["stats"]:
            assert s["bytes"] == _shard_bytes(r) < 0.7 * _model_bytes(), s
            assert s["fallbacks"] == 1
    # every trainer rank sent part of it (balanced by bytes, a tensor per sender)
    sent = [sum(s["wire_bytes"] for s in out[t]["stats"]) for t in range(T)]
    assert all(b > 0 for b in sent), sent


@pytest.mark.parametrize("T,mixed", [(2, False), (3, False), (3, True)])
def test_fsdp_trainers_each_send_their_own_rows(port, T, mixed):
    """The trainers hold the weights as FSDP2 does (dim-0 shards, uneven: 11 rows over 3
    ranks are 4, 4, 3; 3 rows, 1, 1, 1; the receivers split some along dim 1, across the
    trainers' rows). Each trainer sends the receivers' pieces of its own rows: no
    collective at all on the trainers, every trainer sends part of every update, no byte
    is sent twice, and every rank's regions are bitwise the trainer's, update after
    update (the shards written in place between them). ``mixed``: beside them a plain
    tensor (sent whole by one trainer, no collective) and a replicated DTensor (the one
    tensor made whole: one ``full_tensor`` per update)."""
    from weightbus.comm import free_port
    out = spawn(ws.run, T + R, (T, R, port, 3, 4096, False, 1, 0, "gloo", free_port(), mixed), timeout=240)
    for r in range(R):
        got = out[T + r]
        assert got["wrong"] == [], got["wrong"]
        assert got["whole"] == ["rotary.inv_freq"]
        assert [s["bytes"] for s in got["stats"]] == [_shard_bytes(r)] * 3, got["stats"]
    for t in range(T):
        want = {"full_tensor": 1, "redistribute": 1} if mixed else {}  # (full_tensor redistributes)
        assert out[t]["collectives"] == [want] * 3, out[t]["collectives"]
        assert all(s["wire_bytes"] > 0 for s in out[t]["stats"]), (t, out[t]["stats"])
    # each trainer sent the buckets of its rows the plan names (each piece once), no more
    plan = _fsdp_plan(T, mixed)
    for t in range(T):
        assert [s["wire_bytes"] for s in out[t]["stats"]] == [sum(b.wire_bytes for b in plan.sent_by(t))] * 3


def _fsdp_plan(T, mixed=False):
    """The plan of an FSDP2-sharded source (torch.chunk's rows over T trainers; ``mixed``:
    the norm and the rotary table whole)."""
    from weightbus.engines.sharded import check_placements
    metas = [TensorMeta(n, torch.float32, s) for n, s in ws.SHAPES.items()]
    splits = []
    for n, s in ws.SHAPES.items():
        step = -(-s[0] // T)
        whole = mixed and n in ("norm.weight", "rotary.inv_freq")
        splits.append(None if whole else (0, [min(s[0], k * step) for k in range(T + 1)]))
    layouts = [check_placements(ws.placements(ws.rollout_params(r, R), r, R), "test") for r in range(R)]
    return ShardPlan(Manifest(metas, splits=splits), layouts, 4096, T)


@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_a_plan_of_split_tensors_sends_each_piece_from_the_rows_that_hold_it(T):
    """Split tensors: every piece a sender packs lies in its own rows, every receiver gets
    each element it wants once; more senders than rows leave the extra ones out."""
    plan = _fsdp_plan(T)
    metas = plan.manifest.metas
    assert set(plan.split) == set(range(len(metas)))
    for b in plan:
        for p in b.pieces:
            lo, hi = plan.split[p.tensor][1][b.owner:b.owner + 2]
            assert lo <= p.box.start[0] and p.box.start[0] + p.box.size[0] <= hi, (b.owner, p)
    for r in range(R):
        got: dict = {}
        for b in plan.received_by(r):
            for p in b.pieces:
                got.setdefault(p.tensor, []).append(p.box)
        for i, boxes in got.items():  # (no element twice)
            assert not any(a.overlaps(c) for j, a in enumerate(boxes) for c in boxes[j + 1:]), metas[i]
        assert plan.bytes_for(r) == _shard_bytes(r)
    if T == 5:  # (3 rows over 5 trainers: the last two hold none of only_rank0.weight)
        i = [m.name for m in metas].index("only_rank0.weight")
        assert {b.owner for b in plan for p in b.pieces if p.tensor == i} == {0, 1, 2}


@pytest.mark.parametrize("T", [1, 2, 3])
def test_a_split_tensor_of_no_elements_reaches_each_receiver_once(T):
    """A tensor of size 0 (no rows, or no columns) that receivers take whole: one piece of
    no bytes each, from one sender, so each receiver assembles it, and yields it, once."""
    shapes = {"no_rows": (0, 8), "no_cols": (4, 0), "w": (5, 3)}
    metas = [TensorMeta(n, torch.float32, s) for n, s in shapes.items()]
    splits = [(0, [min(s[0], k * -(-s[0] // T)) for k in range(T)] + [s[0]]) for s in shapes.values()]
    plan = ShardPlan(Manifest(metas, splits=splits), [None, None], 4096, T)
    for r in range(R):
        pieces = [p for b in plan.received_by(r) for p in b.pieces]
        assert sorted(p.tensor for p in pieces if p.tensor < 2) == [0, 1], pieces
        assert sum(p.box.numel for p in pieces if p.tensor == 2) == 15


def test_destinations_moved_between_updates_are_written_where_they_are_now(port):
    """The receiver tables its destinations' views once (a MoE's buckets hold thousands of
    pieces); a destination whose memory moved under the same tensor object since (``set_``,
    ``param.data = ...``) is written in its new memory, not its old, at every update."""
    T = 1
    out = spawn(ws.run, T + R, (T, R, port, 4, 4096, True), timeout=240)
    for r in range(R):
        assert out[T + r]["wrong"] == [], out[T + r]["wrong"]


def test_a_region_no_source_holds_fails_before_a_byte_moves(port):
    T = 2
    out = spawn(ws.bad_layout, T + R, (T, R, port), timeout=120)
    for rank, res in enumerate(out):
        assert res["error"] and "rollout rank 1, tensor 'q.weight': region [4:10, 0:8] does not fit" \
            in res["error"], (rank, res)
    assert out[T]["untouched"] and out[T + 1]["untouched"]


def test_layouts_stated_per_update_travel_with_it(port):
    T = 2
    out = spawn(ws.changing_layout, T + R, (T, R, port), timeout=120)
    for rank, res in enumerate(out):
        assert res["error"] and "rollout rank 3: its shard layout for version 3: the loaders changed" \
            in res["error"], (rank, res)
        assert res["version"] == 2
    for r in range(R):
        res = out[T + r]
        assert res["held"] == [True, True, True], res  # update 3 wrote nothing anywhere
        assert res["bytes"] == [4 * 8 * 4] * 2  # its half of q.weight, nothing else


def test_the_plan_matches_what_the_engines_moved():
    """The test's expectation comes from the plan the engines compute (a pure function)."""
    metas = [TensorMeta(n, ws.weights(1)[n].dtype, s) for n, s in ws.SHAPES.items()]
    layouts = []
    for r in range(R):
        from weightbus.engines.sharded import check_placements
        layouts.append(check_placements(ws.placements(ws.rollout_params(r, R), r, R), "test"))
    plan = ShardPlan(Manifest(metas), layouts, 4096, 2)
    assert [plan.bytes_for(r) for r in range(R)] == [_shard_bytes(r) for r in range(R)]


@pytest.mark.parametrize("T", [1, 2])
def test_a_torch_tensor_parallel_module_takes_its_dtensor_shards(port, T):
    """Placements from DTensors (torch's parallelize_module): each rank receives about half
    of the model (the row-parallel bias is replicated), bitwise, and the TP forward pass
    equals the trainer's."""
    from weightbus.comm import free_port
    out = spawn(ws.torch_tp, T + R, (T, R, port, free_port(), 3), timeout=240)
    for r in range(R):
        got = out[T + r]
        assert got["wrong"] == [], got["wrong"]
        assert all(b < 0.6 * got["model_bytes"] for b in got["bytes"]), got


def test_the_manager_sends_a_tp_replica_only_its_shards():
    """CheckpointEngineManager over local worker groups: 2 trainer ranks, one replica of 2
    workers under torch's tensor parallelism (placements from its DTensors). Each update
    lands bitwise; each rollout worker receives about half of the model."""
    from weightbus.comm import free_port
    from weightbus.manager import CheckpointEngineManager
    from weightbus.runtime.group import LocalWorkerGroup, call
    trainer = LocalWorkerGroup(ws.PlainTrainer, 2, name="trainer")
    replica = LocalWorkerGroup(ws.TPRollout, 2, free_port(), name="tp-replica")
    mgr = CheckpointEngineManager("gloo", trainer, [replica], timeout=60)
    try:
        for step in (1, 2, 3):
            call(trainer, "step", step, timeout=60)
            report = mgr.update_weights(version=step)
            want = call(trainer, "state", timeout=60)[0]
            for got in call(replica, "full", timeout=60):
                assert all(torch.equal(got[n], want[n]) for n in want), step
            assert mgr.versions() == {"tp-replica": step}
        model = sum(t.numel() * 4 for t in want.values())
        assert report.bytes == model  # (what the trainers sent: the whole model, once)
        got = call(replica, "received", timeout=60)
        assert all(b < 0.6 * model for b in got) and sum(got) < 1.1 * model, got
    finally:
        mgr.shutdown()
        trainer.shutdown()
        replica.shutdown()


# ------------------------------------------------------------------ delta on sharded receive

@pytest.mark.parametrize("T,R_,replicas,relay,fsdp,dtype,bucket,rounds",
                         [(1, 2, 2, 0, False, "float8_e4m3fn", 4096, None),
                          (2, 3, 1, 0, True, "bfloat16", 512, (4, 1, 1, 3, 2)),
                          (1, 2, 3, 1, False, "bfloat16", 512, 4)],
                         ids=["fp8-direct-2x-tp2", "fsdp2-to-tp3", "relay-3x-tp2-in-rounds"])
def test_delta_on_sharded_receive_lands_each_change_on_its_keeper(port, T, R_, replicas, relay, fsdp, dtype,
                                                                   bucket, rounds):
    """delta=True in a sharded group (issue 54): the first update goes whole, the next ones
    as the changes of each receiver's own regions (uneven splits, fused qkv, experts, a
    replicated norm in a strided destination, a tensor its layout leaves out written into
    a destination of its own), each applied in place and checked; every rank bitwise after
    every update (2% of every tensor changing per step, bf16). From FSDP2 trainers each
    sends the changes of its own rows; direct, every replica is fed (the replicas' pieces
    diffed once; here in fp8 serving precision, e4m3 bytes end to end); relayed, the
    trainer feeds the first replica only (here in 4 rounds of small buckets: each round's
    sizes agreed, its buckets relayed and patched while the trainer diffs the next). The
    senders choose their rounds, and may differ (the FSDP2 case: the two trainers set 4
    and 1, the receivers something else again)."""
    from weightbus.comm import free_port
    out = spawn(ws.run_delta, T + R_ * replicas,
                (T, R_, port, 4, bucket, replicas, relay, free_port() if fsdp else None, 0.02, None, 1, dtype,
                 "cpu", rounds), timeout=240)
    for q in range(R_ * replicas):
        got = out[T + q]
        assert got["errors"] == [None] * 4 and got["wrong"] == [], (q, got["errors"], got["wrong"])
        assert [s["delta"] for s in got["stats"]] == [False, True, True, True]
        full, *deltas = [s["wire_bytes"] for s in got["stats"]]
        # (every byte a trailer or a record's; a 512-byte bucket's trailer is an eighth of it)
        assert max(deltas) < (0.5 if bucket > 1024 else 0.75) * full, (q, full, deltas)
        assert len({s["bytes"] for s in got["stats"]}) == 1  # (its shard, whatever went on the wire)
    sent = [sum(s["wire_bytes"] for s in out[t]["stats"][1:]) for t in range(T)]
    roots = [T + q for q in range(R_ * (1 if relay else replicas))]  # (relayed: the first replica's)
    assert sum(sent) == sum(sum(s["wire_bytes"] for s in out[q]["stats"][1:]) for q in roots), sent
    assert all(b > 0 for b in sent), sent  # (each FSDP trainer sends the changes of its rows)


def test_delta_on_sharded_receive_catches_a_drifted_copy_then_resyncs(port):
    """A rollout rank's copy of its shard changed between updates where no patch wrote (a
    bit flipped in its up.weight rows): the next update fails on every rank naming that
    region, no rank claims its version, the one after goes whole and lands bitwise, and
    the deltas go on."""
    T = 1
    out = spawn(ws.run_delta, T + R, (T, R, port, 5, 4096, 1, 0, None, 0.02, 3), timeout=240)
    for rank, got in enumerate(out):
        errors = got["errors"]
        assert errors[:2] == [None, None] and errors[3:] == [None, None], (rank, errors)
        assert "up.weight[4:7, 0:8]" in errors[2] and "no longer holds what the trainer sent" in errors[2]
        assert [s and s["delta"] for s in got["stats"]] == [False, True, None, False, True]
    assert all(got["wrong"] == [] for got in out[T:])


def test_delta_checks_the_whole_copy_every_verify_every_updates(port):
    """``verify_every=2``: the whole copy is read every second delta update, before that
    update writes, so a bit flipped before update 2 (not checked there) fails update 3,
    naming the region, and update 4 goes whole and lands bitwise."""
    out = spawn(ws.run_delta, 1 + R, (1, R, port, 5, 4096, 1, 0, None, 0.02, 2, 2), timeout=240)
    for rank, got in enumerate(out):
        errors = got["errors"]
        assert errors[:2] == [None, None] and errors[3:] == [None, None], (rank, errors)
        assert "up.weight[4:7, 0:8]" in errors[2] and "no longer holds what the trainer sent" in errors[2]
        assert [s and s["delta"] for s in got["stats"]] == [False, True, None, False, True]
    flipped = 1 + 1  # (rollout rank 1: its copy was wrong after update 2, which did not read it)
    assert out[flipped]["wrong"] == ["2:up.weight"]
    assert all(got["wrong"] == [] for q, got in enumerate(out[1:], 1) if q != flipped)


def test_delta_on_sharded_receive_sends_a_bucket_dense_where_its_records_do_not_fit(port):
    """A bucket full of pieces whose every element changed: its records (a header each)
    would overflow it, so that bucket alone goes dense, agreed before a byte moves; the
    update stays a delta update, and the next one, at 2%, goes as records; bitwise."""
    out = spawn(ws.delta_dense_bucket, 2, (port,), timeout=120)
    for got in out:
        assert got["delta"] == [False, True, True]
    assert out[1]["wrong"] == []
    assert out[1]["dense"] == [1, 0], out[1]["dense"]  # (the full update agrees on no sizes)
