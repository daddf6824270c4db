"""Shards relayed between replicas (``relay=k`` on a sharded group), over gloo, across real
processes: 3 replicas of a tensor-parallel rollout (TP=2, uneven splits, a fused qkv,
experts); the trainers feed rank r of the first replica only, which forwards each bucket
as it arrives to rank r of the next (a chain, or a tree). Every rank keeps its regions,
bitwise, at every update of changing weights, while the trainers send each shard once per
layout instead of once per replica. (A relay node dying mid-update: tests/test_faults.py; bad
relay options: tests/test_bad_inputs.py.)"""

import pytest
import torch
import workers_shards as ws

from weightbus.engines.sharded import check_placements
from weightbus.packing.shards import ShardLayout, ShardPlan
from weightbus.plan import Manifest, TensorMeta
from weightbus.runtime.local import spawn

P = 2  # tensor-parallel ranks per replica


def _manifest() -> Manifest:
    return Manifest(TensorMeta(n, torch.float32, s) for n, s in ws.SHAPES.items())


def _layout(tp: int) -> ShardLayout:
    return check_placements(ws.placements(ws.rollout_params(tp, P), tp, P), "test")


def _shard_bytes(tp: int) -> int:
    return sum(t.numel() * 4 for t in ws.expected(1, tp, P).values()) + 5 * 4  # + rotary, whole


def test_the_plan_relays_within_each_layout_and_sends_only_to_the_roots():
    layouts = [_layout(q % P) for q in range(4 * P)]  # 4 replicas of TP=2
    direct = ShardPlan(_manifest(), layouts, 4096, 1)
    chain = ShardPlan(_manifest(), layouts, 4096, 1, relay=1)
    tree = ShardPlan(_manifest(), layouts, 4096, 1, relay=2)
    assert chain.relay_from == [None, None, 0, 1, 2, 3, 4, 5] and chain.relay_depth == 3
    assert chain.relay_to[0] == (2,) and chain.relay_to[6] == ()
    assert tree.relay_from == [None, None, 0, 1, 0, 1, 2, 3] and tree.relay_depth == 2
    assert tree.relay_to[0] == (2, 4) and tree.relay_to[2] == (6,)
    for plan in (chain, tree):
        assert {b.receiver for b in plan} == {0, 1}  # the senders feed the roots only
        assert sum(b.wire_bytes for b in plan) * 4 == sum(b.wire_bytes for b in direct)
        for q in range(4 * P):  # a relayed rank takes its root's buckets, in the same order
            assert plan.received_by(q) == plan.received_by(q % P)
            assert plan.bytes_for(q) == direct.bytes_for(q) == _shard_bytes(q % P)
    # ranks whose layouts differ are never relayed to each other: a rank without a layout
    # (whole tensors) and a replica of another parallelism form trees of their own
    mixed = ShardPlan(_manifest(), [_layout(0), None, _layout(0), None, _layout(1)], 4096, 1, relay=1)
    assert mixed.relay_from == [None, None, 0, 1, None]


@pytest.mark.parametrize("T, relay", [(1, 1), (2, 2)])
def test_relayed_shards_land_bitwise_at_every_update(port, T, relay):
    """3 replicas of TP=2 (6 rollout ranks): a chain (relay=1) or a tree (relay=2); 3
    updates with every element changing; buckets of 4 KiB, so each shard spans several."""
    replicas, steps = 3, 3
    out = spawn(ws.run, T + P * replicas, (T, P, port, steps, 4096, False, replicas, relay), timeout=240)
    for q in range(P * replicas):
        got = out[T + q]
        assert got["wrong"] == [], (q, got["wrong"])
        assert [s["bytes"] for s in got["stats"]] == [_shard_bytes(q % P)] * steps, q
    # the trainers sent each shard once per layout: what one replica receives, not three
    sent = sum(out[t]["stats"][-1]["wire_bytes"] for t in range(T))
    one_replica = sum(out[T + q]["stats"][-1]["wire_bytes"] for q in range(P))
    assert sent == one_replica, (sent, one_replica)


def test_a_replica_joining_from_a_live_peer_takes_the_next_delta(port):
    """Delta mode over a relayed sharded group (the manager; 2 replicas of TP=2, a chain):
    a replica that joins from a live peer (``join_from_peer``: the peer's shards copied,
    the trainer not involved) is a leaf of its layout's tree, so the next update stays a
    delta for every replica, the joiner's included, and lands bitwise on all of them. One
    added the usual way (``add_replicas``: it holds nothing) makes the next one whole."""
    from weightbus.manager import CheckpointEngineManager
    from weightbus.runtime.group import LocalWorkerGroup, call
    trainer = LocalWorkerGroup(ws.ToyTrainer, 1, name="trainer")
    reps = [LocalWorkerGroup(ws.ToyTPRollout, P, name=f"r{i}") for i in range(2)]
    groups = [trainer, *reps]
    mgr = CheckpointEngineManager("gloo", trainer, reps, timeout=30, relay=1, delta=True, bucket_size=1024)

    def step(version: int, delta: bool) -> None:
        call(trainer, "train_step", version, timeout=30)
        report = mgr.update_weights(version=version)
        assert report.delta is delta, (version, report)
        for g in mgr.replicas:
            assert call(g, "wrong", version, timeout=30) == [[]] * P, (g.name, version)
    try:
        step(1, False)  # (the first update is whole)
        step(2, True)
        late = LocalWorkerGroup(ws.ToyTPRollout, P, name="late")
        groups.append(late)
        got = mgr.join_from_peer(late)
        assert got["version"] == 2 and call(late, "wrong", 2, timeout=30) == [[]] * P
        step(3, True)  # (the joiner adopted the peer's chain and its plan: still a delta)
        fresh = LocalWorkerGroup(ws.ToyTPRollout, P, name="fresh")
        groups.append(fresh)
        mgr.add_replicas([fresh])
        step(4, False)  # (it holds nothing: every replica takes this one whole)
        step(5, True)
    finally:
        mgr.shutdown()
        for g in groups:
            g.shutdown(timeout=2)
