"""Delta mode's encoding, in one process: every record kind round-trips bitwise into the
receiver's tensors, the GPU grouping finds the same changes as the per-piece diff, and a
corrupt or misplaced patch is caught naming the tensor. (Across processes, with real
optimizer steps and FSDP2 shards: tests/test_engines.py and tests/test_manager.py.)"""

import pytest
import torch

from weightbus.engines import delta as dm
from weightbus.plan import Manifest, TensorMeta

SHAPES = [("a", (300, 7)), ("b", (5,)), ("c", (4096,)), ("d", (1,))]


def _setup(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=g).to(dtype) for _, s in SHAPES]
    manifest = Manifest(TensorMeta(n, dtype, s) for n, s in SHAPES)
    return weights, manifest


def _pieces(weights):
    for i, w in enumerate(weights):
        yield i, 0, w.view(-1)


def _mutate(weights, fraction, seed):
    g = torch.Generator().manual_seed(seed)
    for w in weights:
        flat = w.view(-1)
        k = max(1, round(flat.numel() * fraction))
        idx = torch.randint(0, flat.numel(), (k,), generator=g)
        dm._bits(flat)[idx] += 1


def _deliver(recs, targets, manifest, full):
    slot = torch.zeros(8 + sum(r.size for r in recs), dtype=torch.uint8)
    dm._fill(slot, recs)
    return dm._apply(slot, slot.numel(), targets, manifest, full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_round_trip_every_kind(dtype):
    weights, manifest = _setup(dtype)
    snaps = dm.Snapshots()
    targets = [torch.zeros_like(w).view(-1) for w in weights]
    _deliver(dm.records(_pieces(weights), manifest, snaps, True, 1 << 20), targets, manifest, True)
    kinds = set()
    for step, fraction in enumerate([0.001, 0.02, 0.2, 0.9]):
        _mutate(weights, fraction, step)
        recs = dm.records(_pieces(weights), manifest, snaps, False, 1 << 20)
        kinds |= {r.head[1] for r in recs}
        _deliver(recs, targets, manifest, False)
        for w, t in zip(weights, targets, strict=True):
            assert torch.equal(dm._bits(w.view(-1)), dm._bits(t))  # bitwise
    assert kinds == {dm.SPARSE, dm.BITMAP, dm.DENSE}  # each encoding chosen where it is smallest


def test_small_buckets_split_records():
    weights, manifest = _setup()
    recs = dm.records(_pieces(weights), manifest, dm.Snapshots(), True, 1024)
    assert max(r.size for r in recs) <= 1024 and len(recs) > len(weights)


def test_grouped_diff_finds_the_same_changes():
    """What a GPU does (every piece's mask side by side, one nonzero), checked on the CPU."""
    weights, manifest = _setup()
    snaps = [w.view(-1).clone() for w in weights]
    _mutate(weights, 0.05, 7)
    group = [(i, 0, w.view(-1), s.clone()) for i, (w, s) in enumerate(zip(weights, snaps, strict=True))]
    grouped = list(dm._encode_group(group))
    single = [dm.encode(i, 0, w.view(-1), s.clone(), False) for i, (w, s) in enumerate(zip(weights, snaps,
                                                                                          strict=True))]
    single = [r for r in single if r is not None]
    assert [r.head for r in grouped] == [r.head for r in single]
    assert all(torch.equal(a, b) for x, y in zip(grouped, single, strict=True) for a, b in zip(x.body, y.body,
                                                                                                strict=True))


def test_corrupt_or_misplaced_patch_is_named():
    weights, manifest = _setup()
    snaps = dm.Snapshots()
    targets = [torch.zeros_like(w).view(-1) for w in weights]
    _deliver(dm.records(_pieces(weights), manifest, snaps, True, 1 << 20), targets, manifest, True)
    _mutate(weights, 0.01, 1)
    recs = dm.records(_pieces(weights), manifest, snaps, False, 1 << 20)
    sparse = next(r for r in recs if r.head[1] == dm.SPARSE)
    sparse.body[-1][:1] ^= 1  # a value's bit, after the trainer took its digest
    with pytest.raises(dm._Drift, match=f"tensor '{SHAPES[sparse.head[0]][0]}'"):
        _deliver([sparse], [t.clone() for t in targets], manifest, False)
    sparse.body[-1][:1] ^= 1
    sparse.body[0].view(torch.int32)[0] += 1  # a position moved
    with pytest.raises(dm._Drift, match="do not match the trainer's"):
        _deliver([sparse], [t.clone() for t in targets], manifest, False)
    sparse.body[0].view(torch.int32)[0] = 1 << 30  # a position outside the tensor
    with pytest.raises(dm._Drift, match="do not match the trainer's"):
        _deliver([sparse], [t.clone() for t in targets], manifest, False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 1000, 4099])
def test_changed_positions(dtype, n):
    a = (torch.randn(n) * 10).to(dtype)
    b = a.clone()
    dm._bits(b)[torch.randint(0, n, (max(1, n // 10),))] += 1
    for sl in (slice(None), slice(1, None)):  # aligned, and not 8-byte aligned
        want = (dm._bits(b)[sl] != dm._bits(a)[sl]).nonzero().squeeze(1)
        assert torch.equal(dm._changed(dm._bits(b)[sl], dm._bits(a)[sl]).sort().values, want)
