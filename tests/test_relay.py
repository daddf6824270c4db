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
