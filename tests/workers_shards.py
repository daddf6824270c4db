"""Sharded receive across real processes (spawned by tests/test_sharded.py): T trainer
ranks send a toy transformer block's weights; R rollout ranks hold it tensor-parallel
(column and row splits, uneven splits, q/k/v fused into one parameter, experts split by
rank, a replicated norm, a tensor their layout leaves whole, one a rank does not keep)."""

import asyncio

import torch

from weightbus import CheckpointEngineRegistry, ModuleSource
from weightbus.runtime.local import Rendezvous, connect
from weightbus.shards import Box, chunk_box, tp_placements

H = 8
SHAPES = {
    "embed.weight": (11, H),  # vocab-parallel, 11 rows: uneven
    "q.weight": (H, H), "k.weight": (4, H), "v.weight": (4, H),  # fused into qkv on the rollout
    "o.weight": (H, H),  # row-parallel: split along dim 1
    "up.weight": (7, H),  # column-parallel, uneven
    "down.weight": (H, 7),  # row-parallel, uneven
    "norm.weight": (H,),  # replicated
    "experts.w": (4, 6, H),  # expert-parallel: experts split by rank
    "rotary.inv_freq": (5,),  # the layout does not name it: arrives whole (a fallback)
    "only_rank0.weight": (3, 3),  # rollout rank 1 keeps none of it
}
SPLIT = {"embed.weight": 0, "up.weight": 0, "down.weight": 1, "o.weight": 1, "experts.w": 0}


def weights(step: int) -> dict[str, torch.Tensor]:
    """The trainer's weights at ``step`` (every element changes between steps)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def rollout_params(r: int, R: int) -> dict[str, torch.Tensor]:
    """Rollout rank ``r``'s parameters, as a TP engine would hold them (poisoned: NaN)."""
    p = {n: torch.full(chunk_box(SHAPES[n], d, r, R).size, float("nan")) for n, d in SPLIT.items()}
    p["norm.weight"] = torch.full((H,), float("nan"))
    rows = [chunk_box(SHAPES[n], 0, r, R).size[0] for n in ("q.weight", "k.weight", "v.weight")]
    p["qkv.weight"] = torch.full((sum(rows), H), float("nan"))
    if r == 0:
        p["only_rank0.weight"] = torch.full((3, 3), float("nan"))
    return p


def placements(params: dict[str, torch.Tensor], r: int, R: int):
    out = tp_placements({n: t for n, t in params.items() if n != "qkv.weight"}, r, R,
                        split={n: (d, SHAPES[n]) for n, d in SPLIT.items()})
    at = 0
    for n in ("q.weight", "k.weight", "v.weight"):  # vLLM's fused qkv: this rank's rows of each
        box = chunk_box(SHAPES[n], 0, r, R)
        out[n] = [(box, params["qkv.weight"][at:at + box.size[0]])]
        at += box.size[0]
    if r != 0:
        out["only_rank0.weight"] = []
    return out


def expected(step: int, r: int, R: int) -> dict[str, torch.Tensor]:
    w = weights(step)
    want = {n: chunk_box(SHAPES[n], d, r, R).of(w[n]) for n, d in SPLIT.items()}
    want["norm.weight"] = w["norm.weight"]
    want["qkv.weight"] = torch.cat([chunk_box(SHAPES[n], 0, r, R).of(w[n]) for n in ("q.weight", "k.weight",
                                                                                      "v.weight")])
    if r == 0:
        want["only_rank0.weight"] = w["only_rank0.weight"]
    return want


def run(rank: int, T: int, R: int, port: int, steps: int, bucket: int) -> dict:
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    trainer = rank < T
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if trainer else "rollout",
                                          bucket_size=bucket, timeout=30)
    r = rank - T
    if not trainer:
        params = rollout_params(r, R)
        engine.set_shard_destinations(placements(params, r, R))
    connect(engine, rdv, T, R)
    out: dict = {"stats": []}
    for step in range(1, steps + 1):
        if trainer:
            stats = asyncio.run(engine.send_weights(ModuleSource(weights(step)), version=step))
        else:
            async def take():
                return {n: t.clone() async for n, t in engine.receive_weights()}
            whole = asyncio.run(take())
            stats = engine.last_stats
            want = expected(step, r, R)
            out.setdefault("wrong", [])
            out["wrong"] += [f"{step}:{n}" for n, t in params.items() if not torch.equal(t, want[n])]
            out["whole"] = sorted(whole)
            if not torch.equal(whole["rotary.inv_freq"], weights(step)["rotary.inv_freq"]):
                out["wrong"].append(f"{step}:rotary.inv_freq")
        out["stats"].append(stats.to_dict())
    engine.finalize(destroy_group=True)
    return out


def bad_layout(rank: int, T: int, R: int, port: int) -> dict:
    """Rollout rank 1 states a region no source holds (past the end of a tensor): every
    rank fails the update before a byte moves, naming the rank and the tensor; rank 1's
    parameters keep their previous values, and the group stays usable."""
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank < T else "rollout", timeout=30)
    dst = torch.zeros(6, H)
    if rank >= T:
        box = Box.rows(SHAPES["q.weight"], 4, 10) if rank - T == 1 else Box.rows(SHAPES["q.weight"], 0, 6)
        engine.set_shard_destinations({"q.weight": [(box, dst)]})
    connect(engine, rdv, T, R)
    try:
        if rank < T:
            asyncio.run(engine.send_weights(ModuleSource(weights(1)), version=1))
        else:
            async def take():
                return {n: t async for n, t in engine.receive_weights()}
            asyncio.run(take())
        err = None
    except Exception as e:  # noqa: BLE001 - the test reads it
        err = str(e)
    return {"error": err, "untouched": bool((dst == 0).all()), "version": engine.version}
