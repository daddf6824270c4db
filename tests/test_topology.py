"""The forwarding engines' tree choice (``weightbus.planning.topology``) and its layout: pure
functions, checked for every small shape."""

import pytest

from weightbus.errors import PlanError
from weightbus.planning import topology
from weightbus.planning.topology import Fanout


def test_choice_from_link_rates():
    # equal links, or none given: the chain (each byte crosses each link once)
    assert topology.choose(1, 8) == Fanout(1, 1)
    # ... unless there are several senders: each receiver's link then takes several streams,
    # each slower than a sender's link, so a sender feeds more heads (fewer hops, same rate)
    assert topology.choose(2, 8, sender_gbps=25, receiver_gbps=25) == Fanout(2, 1)
    # a sender link 4x a receiver's: four heads, a chain below each
    fan = topology.choose(1, 8, sender_gbps=100, receiver_gbps=25)
    assert fan == Fanout(4, 1) and fan.kind == "tree"
    # ... fast enough for every receiver: direct writes
    assert topology.choose(1, 3, sender_gbps=100, receiver_gbps=25).kind == "direct"
    # two senders: every receiver takes in two streams, so a sender at 2x feeds 4 heads
    assert topology.choose(2, 8, sender_gbps=50, receiver_gbps=25) == Fanout(4, 1)
    # receivers 2x the sender: each relays to two (a binary tree under one head)
    assert topology.choose(1, 7, sender_gbps=25, receiver_gbps=50) == Fanout(1, 2)
    # forced shapes
    assert topology.choose(3, 5, kind="direct") == Fanout(5, 0)
    assert topology.choose(1, 5, kind="tree") == Fanout(1, 2)
    assert topology.choose(1, 1, kind="tree").kind == "chain"
    with pytest.raises(PlanError, match="topology must be one of"):
        topology.choose(1, 2, kind="ring")


@pytest.mark.parametrize("R", range(1, 12))
@pytest.mark.parametrize("fan", [Fanout(1, 1), Fanout(1, 2), Fanout(2, 1), Fanout(3, 2), "direct"])
def test_every_receiver_is_reached_once(R, fan):
    fan = Fanout(R, 0) if fan == "direct" else Fanout(min(fan.sender, R), fan.relay)
    for tree in range(3):
        heads, children = topology.layout(tree, R, fan)
        parent = topology.parent_of(tree, R, fan)
        reached = heads + [c for cs in children.values() for c in cs]
        assert sorted(reached) == list(range(R))  # everyone, once
        assert len(heads) == fan.sender
        assert all(len(cs) <= max(fan.relay, 0) for cs in children.values())
        assert set(parent) == set(range(R)) and all(parent[h] is None for h in heads)
        for p, cs in children.items():
            assert all(parent[c] == p for c in cs)
        # the heads' subtrees differ by at most one receiver per level (balanced senders)
        sizes = [_subtree(h, children) for h in heads]
        assert max(sizes) - min(sizes) <= max(1, fan.relay) ** _depth(heads[0], children)


def test_forwarding_rotates_between_trees():
    """In a chain each receiver forwards in all trees but the one it ends; which receiver
    is the tail rotates, so with T = R every receiver is a tail exactly once."""
    R = 4
    tails = []
    for tree in range(R):
        _, children = topology.layout(tree, R, Fanout(1, 1))
        tails += [r for r, cs in children.items() if not cs]
    assert sorted(tails) == list(range(R))


def _subtree(node, children):
    return 1 + sum(_subtree(c, children) for c in children[node])


def _depth(node, children):
    return 1 + max((_depth(c, children) for c in children[node]), default=0)
