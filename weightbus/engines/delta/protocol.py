"""What delta mode needs of its engine (a ``Protocol``: the engine imports this package),
and the steps both sides take together: the agreement on delta or full, the agreed
bucket plan of each round, the settling of an update."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from weightbus.engines.delta.encoding import _NEUTRAL
from weightbus.packing import buffers
from weightbus.plan import Bucket


class Engine(Protocol):
    """What delta mode uses of its engine: a :class:`weightbus.engines.bucket.BucketEngine`
    (which imports this package, so it is described here rather than imported)."""

    role: str | None
    device: torch.device
    version: int | None
    bucket_size: int
    num_buffers: int
    verify_every: int
    n_senders: int
    trainer_rank: int
    last_full: bool | None
    _snapshots: Any  # (the sender's Snapshots and the receiver's Chain: both sides import
    _chain: Any  # this module, so their types are not imported here)
    _delta_pending: Any
    _dest: dict[str, torch.Tensor] | None
    _stamper: buffers.Stamper

    def where(self) -> str: ...
    def _acquire(self, b: Bucket) -> torch.Tensor: ...
    def _send(self, b: Bucket, slot: torch.Tensor) -> None: ...
    def _flush_send(self, plan: Any) -> None: ...
    def _post_recv(self, b: Bucket) -> None: ...
    def _wait_recv(self, b: Bucket) -> torch.Tensor: ...
    def _release(self, b: Bucket) -> None: ...
    def _flush_recv(self, plan: Any) -> None: ...
    def _reduce_max(self, t: torch.Tensor, phase: str) -> None: ...



def _agree(engine: Engine, held: int | None, chain: int | None) -> bool:
    """Whether every rank holds the same version (and every receiver the same chain): one
    max-reduction of the values and of their negations."""
    v = -1 if held is None else held
    c = _NEUTRAL if chain is None else chain
    both = torch.tensor([v, c, -v, _NEUTRAL if chain is None else -c], dtype=torch.int64)
    engine._reduce_max(both, "delta: agreeing on the version held")
    hi, lo = both[:2].tolist(), both[2:].tolist()
    return hi[0] >= 1 and hi[0] == -lo[0] and hi[1] == -lo[1]


#: bucket sizes per trainer rank that travel with a round's counts and flags, in its one
#: max-reduction (a round of more buckets on some rank takes a second, for all of them):
#: a round is a quarter of a rank's pieces by default, a few buckets
_SIZES_AHEAD = 8


def _plan(engine: Engine, mine: list[int], before: list[Bucket], more: bool = False,
          failed: bool = False) -> tuple[list[Bucket], bool]:
    """The buckets of one round of a delta update (bucket b from trainer b mod T, as
    always; numbered on from ``before``, the rounds' so far), from each trainer rank's
    bucket sizes, and whether another round follows (a trainer rank has pieces left, and
    none failed): one max-reduction of the counts, the flags and up to ``_SIZES_AHEAD``
    sizes per rank (each control round trip is ~0.5 ms of a GPU update's critical path);
    a second of every size where some rank has more."""
    T, W = engine.n_senders, _SIZES_AHEAD
    rank = engine.trainer_rank if engine.role == "trainer" else -1
    head = torch.zeros(T + 2 + T * W, dtype=torch.int64)
    if rank >= 0:
        head[rank], head[T], head[T + 1] = len(mine), int(more), int(failed)
        ahead = mine[:W]
        head[T + 2 + rank * W:T + 2 + rank * W + len(ahead)] = torch.tensor(ahead, dtype=torch.int64)
    engine._reduce_max(head, "delta: agreeing on the buckets")
    most = max(1, int(head[:T].max().item()))
    if most <= W:
        sizes = head[T + 2:].view(T, W)
    else:
        sizes = torch.zeros(T, most, dtype=torch.int64)
        if rank >= 0 and mine:
            sizes[rank, :len(mine)] = torch.tensor(mine, dtype=torch.int64)
        engine._reduce_max(sizes.view(-1), "delta: agreeing on the buckets")
    grid = sizes.tolist()
    first, turn = (before[-1].index + 1, before[-1].turn + 1) if before else (0, 0)
    plan = [Bucket(first + k * T + r, r, (), grid[r][k], turn + k)
            for k in range(most) for r in range(T)]
    return plan, bool(head[T].item()) and not head[T + 1].item()


class _PlanView:
    """What the transport's flush hooks read of a plan."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets = tuple(buckets)

    def __len__(self) -> int:
        return len(self.buckets)


def settle(engine: Engine, ok: bool) -> None:
    """After the outcome is agreed: what this rank holds from now on."""
    pending = getattr(engine, "_delta_pending", None)
    engine._delta_pending = None  # type: ignore[attr-defined]
    if engine.role == "trainer":
        snaps = engine._snapshots
        if ok and pending is not None:
            snaps.version, snaps.fingerprint = pending
        else:
            snaps.version = None
    else:
        chain = engine._chain
        chain.version = pending[0] if ok and pending is not None else None
