"""How one sender's buckets reach R receivers in the forwarding engines (``nixl``): a
chain, a tree or direct writes, picked from the link rates, and laid out so that every
receiver carries about the same forwarding work.

Every trainer rank (sender) has its own tree over all R rollout ranks. The sender writes to
``sender_fanout`` heads; every receiver that has children forwards each bucket to up to
``relay_fanout`` of them while it unpacks it. A chain is (1, 1); direct writes are (R, -);
anything else is a tree.

The rule (throughput first, then the fewest hops): with T senders every receiver takes in
T streams at once, so a stream can run at most at ``min(sender / f0, receiver / T)``. A
sender whose link is faster than a receiver's share feeds ``f0 = sender * T / receiver``
heads; a receiver whose link is faster than the T streams it takes in feeds
``f1 = receiver / (T * stream)`` children. With equal links this is the chain (the fastest
when every link is the same: each byte crosses each link once, one hop of latency per
receiver). Rates are each rank's ``link_gbps`` (its NIC; measure it, e.g. with ``weightbus
bench``'s raw row); without them every link counts as equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from weightbus.errors import PlanError

KINDS = ("auto", "chain", "tree", "direct")


@dataclass(frozen=True)
class Fanout:
    """``sender``: heads the sender writes to; ``relay``: children per forwarding receiver."""

    sender: int
    relay: int

    @property
    def kind(self) -> str:
        if self.sender == 1 and self.relay <= 1:
            return "chain"
        return "direct" if self.relay == 0 else "tree"


def choose(senders: int, receivers: int, *, kind: str = "auto", sender_gbps: float | None = None,
           receiver_gbps: float | None = None) -> Fanout:
    """The fan-outs for ``senders`` trees over ``receivers`` receivers (see the module doc).
    ``kind`` forces ``chain``, ``direct`` or a binary ``tree``; ``auto`` decides from the
    rates (the slowest sender's and receiver's)."""
    if kind not in KINDS:
        raise PlanError(f"topology must be one of {KINDS}, got {kind!r}")
    T, R = senders, receivers
    if kind == "chain" or R == 1:
        return Fanout(1, 0 if R == 1 else 1)
    if kind == "direct":
        return Fanout(R, 0)
    if kind == "tree":
        return Fanout(1, 2)
    if not sender_gbps or not receiver_gbps:
        return Fanout(1, 1)
    f0 = max(1, min(R, math.floor(sender_gbps * T / receiver_gbps + 1e-9)))
    if f0 >= R:
        return Fanout(R, 0)
    stream = min(sender_gbps / f0, receiver_gbps / T)
    f1 = max(1, min(R - f0, math.floor(receiver_gbps / (T * stream) + 1e-9)))
    return Fanout(f0, f1)


def layout(tree: int, receivers: int, fan: Fanout) -> tuple[list[int], dict[int, list[int]]]:
    """Tree ``tree`` (one per sender) over receivers ``0..R-1``: (the sender's heads, each
    receiver's children). Trees start at different receivers, so which receivers forward
    (and which are leaves) rotates from tree to tree; heads get subtrees of equal size
    (breadth first)."""
    R = receivers
    order = [(tree + k) % R for k in range(R)]
    heads = order[:fan.sender]
    children: dict[int, list[int]] = {r: [] for r in order}
    frontier, rest = list(heads), order[fan.sender:]
    while rest and fan.relay:
        nxt = []
        for parent in frontier:  # a level at a time: the heads' subtrees stay level
            for _ in range(fan.relay):
                if not rest:
                    break
                children[parent].append(rest.pop(0))
            nxt.extend(children[parent])
        frontier = nxt
    return heads, children


def parent_of(tree: int, receivers: int, fan: Fanout) -> dict[int, int | None]:
    """Each receiver's upstream in tree ``tree`` (None: the sender)."""
    heads, children = layout(tree, receivers, fan)
    up: dict[int, int | None] = {h: None for h in heads}
    for p, cs in children.items():
        for c in cs:
            up[c] = p
    return up
