"""The hot path's guard: per-update work grows with buckets, not with tensors (nor with
the pieces sharded receive cuts them into).

One warm update of a model is counted on each side, in real processes (lines of Python
executed, Python and C functions called, torch operators dispatched), for the same bytes
split into 4x as many tensors. A step per tensor anywhere in the update (a Python loop, a
torch copy or attribute read per tensor, a sink that looks at every tensor) adds thousands;
per-bucket work adds none. Counts, never times: this runs the same on any machine.
"""

from __future__ import annotations

import pytest
import torch
from workers_hotpath import gc_states, update_counts

from weightbus.runtime.local import spawn

FEW, MANY = 1000, 4000  # tensors, for the same bytes
BYTES = 4 << 20  # the model's bytes: the same buckets for both
BUCKET = 1 << 20
#: what one more tensor may add to an update, at most, on each side (per-bucket work is a
#: constant; a Python loop per tensor is several lines, a call per tensor is one)
PER_TENSOR = 0.05


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("backend", ["gloo", "colocated", "gloo-sharded", "gloo-fsdp",
                                     pytest.param("colocated-direct", marks=GPU)])
def test_update_work_grows_with_buckets_not_tensors(backend, port):
    # (sharded: a trainer, a replica of TP=2; fsdp: two FSDP2 trainer ranks, that replica)
    ranks = {"gloo-sharded": 3, "gloo-fsdp": 4}.get(backend, 2)
    from weightbus.comm import free_port
    few = spawn(update_counts, ranks, (backend, FEW, BYTES // FEW, BUCKET, port, free_port()), timeout=120)
    import torch.distributed as dist  # a second store: the first one's keys are used
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    many = spawn(update_counts, ranks, (backend, MANY, BYTES // MANY, BUCKET, store.port, free_port()),
                 timeout=120)
    sides = [("trainer " if got["trainer"] else "rollout ") + str(r) for r, got in enumerate(few)]
    for side, a, b in zip(sides, few, many, strict=True):
        assert a["buckets"] == b["buckets"], (side, a, b)
        for what in ("lines", "calls", "ops"):
            grown = b[what] - a[what]
            assert grown <= PER_TENSOR * (MANY - FEW), (
                f"{backend} {side}: one warm update's {what} grew by {grown} for {MANY - FEW} more "
                f"tensors in the same {a['buckets']} buckets ({a[what]} -> {b[what]}): something "
                f"in the hot path works per tensor")
    for got in (few, many):  # delivered, bitwise (sharded: each rank its half)
        sent = sum(r["sum"] for r in got if r["trainer"])
        assert sent == sum(r["sum"] for r in got if not r["trainer"]), got


@GPU
def test_fp8_quantization_of_unmoved_tensors_does_not_grow_with_them():
    """A warm ``quantize_many`` over a model's unmoved weights (what ``QuantizedSource`` runs
    at every update) replays its launch: counted for 1,000 and 4,000 weights of the same
    bytes, and bitwise the plain path's."""
    pytest.importorskip("triton")
    from workers_hotpath import counted

    from weightbus.quant import Fp8Format, quantize_many
    fmt = Fp8Format("block")
    counts = []
    for n in (FEW, MANY):
        rows = (BYTES // 2) // n // 128  # (elements per weight, in rows of 128)
        xs = [torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16) for _ in range(n)]
        items = [(fmt, x) for x in xs]
        cache: dict = {}
        for _ in range(2):  # (set up, then the first replay's one launch)
            quantize_many(items, cache)
        for x in xs:
            x.mul_(1.5)
        got: list = []

        def call(items=items, cache=cache, got=got) -> None:  # noqa: ANN001
            got.extend(quantize_many(items, cache))

        counts.append(counted(call))
        for x, (q, s) in zip(xs[::97], got[::97], strict=True):
            rq, rs = fmt.quantize(x)
            assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    for what in ("lines", "calls", "ops"):
        grown = counts[1][what] - counts[0][what]
        assert grown <= PER_TENSOR * (MANY - FEW), (
            f"fp8: a warm call's {what} grew by {grown} for {MANY - FEW} more weights "
            f"({counts[0][what]} -> {counts[1][what]}): something works per tensor")


@GPU
def test_fp8_written_into_a_colocated_rollout_does_not_grow_with_the_weights():
    """A warm ``QuantizedSource.direct_writer`` call over unmoved weights (an fp8 update in
    colocated direct mode: the kernel writing the rollout's payloads, then one tabled copy
    of the scales and the tensors served as they are), counted for 1,000 and 4,000 weights
    of the same bytes, and bitwise the plain path's."""
    pytest.importorskip("triton")
    from workers_hotpath import counted

    from weightbus import ModuleSource
    from weightbus.packing import native
    from weightbus.quant import Fp8Format, QuantizedSource
    native.pointer_library(wait=True)  # (counted as it runs once built: not while it builds)
    fmt = Fp8Format("block")
    counts = []
    for n in (FEW, MANY):
        rows = (BYTES // 2) // n // 128  # (elements per weight, in rows of 128)
        weights = {f"w{i}.weight": torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
                   for i in range(n)}
        weights["norm.weight"] = torch.randn(128, device="cuda", dtype=torch.bfloat16)  # (served as it is)
        source = QuantizedSource(ModuleSource(weights), {k: fmt for k in weights if k != "norm.weight"})
        dests = [torch.empty(m.shape, dtype=m.dtype, device="cuda") for m in source.manifest]
        write = source.direct_writer(dests)
        for _ in range(2):  # (set up, then a warm call)
            assert write()
        for t in weights.values():
            t.mul_(1.5)
        counts.append(counted(write))
        torch.cuda.synchronize()
        for i in range(0, n, 97):  # (weight i's payload and scale are destinations 2i and 2i + 1)
            rq, rs = fmt.quantize(weights[f"w{i}.weight"])
            assert torch.equal(dests[2 * i].view(torch.uint8), rq.view(torch.uint8))
            assert torch.equal(dests[2 * i + 1], rs)
        assert torch.equal(dests[-1], weights["norm.weight"])
    for what in ("lines", "calls", "ops"):
        grown = counts[1][what] - counts[0][what]
        assert grown <= PER_TENSOR * (MANY - FEW), (
            f"fp8 writer: a warm call's {what} grew by {grown} for {MANY - FEW} more weights "
            f"({counts[0][what]} -> {counts[1][what]}): something works per tensor")


@pytest.mark.parametrize("delta", [False, True], ids=["dense", "delta"])
def test_an_update_pauses_the_collector_only_while_it_works(delta, port):
    """Python's cyclic collector is off while a send reads its source and on while a
    receive's consumer holds a tensor (a consumer that never closes its stream cannot leave
    it off); after every update it is as it was before (off where the caller turned it off)."""
    trainer, rollout = spawn(gc_states, 2, (port, delta), timeout=120)
    assert trainer["after"] == [True, True, False] and rollout["after"] == [True, True, True]
    assert trainer["seen"] and not any(trainer["seen"]), trainer["seen"]
    assert delta or (rollout["seen"] and all(rollout["seen"])), rollout["seen"]
