import pytest
import torch

from weightbus import CheckpointEngineRegistry, Manifest, PlanError, TensorMeta, WeightbusError
from weightbus.packing.buffers import Assembler, Packer
from weightbus.plan import ALIGNMENT, TRAILER_BYTES, BucketPlan


def _manifest(*shapes_dtypes):
    return Manifest(TensorMeta(f"t{i}", d, s) for i, (s, d) in enumerate(shapes_dtypes))


def test_fingerprint_is_stable_and_order_sensitive():
    a = _manifest(((3, 4), torch.float32), ((5,), torch.int64))
    b = _manifest(((3, 4), torch.float32), ((5,), torch.int64))
    c = Manifest(reversed(a.metas))
    assert a.fingerprint == b.fingerprint and a == b
    assert a.fingerprint != c.fingerprint
    assert Manifest.from_bytes(a.to_bytes()) == a
    assert "position 0" in a.first_difference(c)


def test_duplicate_names_are_rejected_by_name():
    with pytest.raises(PlanError, match="'w'"):
        Manifest([TensorMeta("w", torch.float32, (2,)), TensorMeta("w", torch.float32, (2,))])


def test_empty_stream_and_tiny_bucket_are_clear_errors():
    with pytest.raises(PlanError, match="empty"):
        BucketPlan(Manifest([]), 1 << 20)
    with pytest.raises(PlanError, match="too small"):
        BucketPlan(_manifest(((4,), torch.float32)), ALIGNMENT)


@pytest.mark.parametrize("bucket_size", [ALIGNMENT + TRAILER_BYTES, 1000, 4096 + 3, 1 << 16])
def test_plan_covers_every_byte_once(bucket_size):
    m = _manifest(((1000, 7), torch.float32), ((), torch.bfloat16), ((0, 3), torch.float16),
                  ((3,), torch.bool), ((513,), torch.int64), ((9, 11), torch.float16))
    plan = BucketPlan(m, bucket_size, n_senders=3)
    assert plan.buckets == BucketPlan(m, bucket_size, n_senders=3).buckets  # deterministic
    covered = {i: [] for i in range(len(m))}
    for b in plan.buckets:
        assert b.owner == b.index % 3
        assert b.wire_bytes <= bucket_size
        end = 0
        for c in b.chunks:
            assert c.dst_offset % ALIGNMENT == 0 or c.nbytes == 0
            assert c.dst_offset >= end
            assert c.nbytes % m[c.index].itemsize == 0
            end = c.dst_offset + c.nbytes
            covered[c.index].append((c.src_offset, c.nbytes))
    for i, meta in enumerate(m):
        ranges = sorted(covered[i])
        assert ranges, meta.name
        pos = 0
        for off, n in ranges:
            assert off == pos
            pos += n
        assert pos == meta.nbytes


def test_pack_then_unpack_roundtrips_with_cast_and_split():
    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(5000, generator=g), "nc": torch.randn(30, 20, generator=g).t(),
               "i": torch.arange(7), "s": torch.tensor(2.5), "e": torch.empty(0, 4),
               "b": torch.rand(9, generator=g) > 0.5}
    wire = {k: (torch.bfloat16 if v.is_floating_point() else v.dtype) for k, v in tensors.items()}
    m = Manifest(TensorMeta(k, wire[k], tuple(v.shape)) for k, v in tensors.items())
    plan = BucketPlan(m, 1024, 1)
    assert len(plan) > 5
    # the same two slots every update (views of them are made once), the second update
    # with changed values, unpacked once into views and once into destinations
    slots = [torch.full((1024,), 0xAB, dtype=torch.uint8) for _ in range(2)]
    packer = Packer(plan)
    dest = {k: torch.zeros(v.shape, dtype=wire[k]) for k, v in tensors.items()}
    for update, destinations in ((0, None), (1, dest)):
        if update:
            tensors = {k: (v * 2 if v.is_floating_point() else v + 1) if v.dtype != torch.bool else ~v
                       for k, v in tensors.items()}
        asm = Assembler(plan, torch.device("cpu"), destinations)
        got = {}
        for b in plan.buckets:
            slot = slots[b.index % 2]
            packer.pack_bucket(slot, b, [tensors[m[c.index].name] for c in b.chunks])
            for name, t in asm.unpack(slot, b):
                got[name] = t.clone()
                if destinations is not None:
                    assert t is dest[name]
        assert list(got) == list(tensors)
        for k, v in tensors.items():
            assert torch.equal(got[k], v.to(wire[k])), (update, k)


def test_unknown_backend_lists_registered_ones():
    with pytest.raises(WeightbusError, match="unknown checkpoint engine backend 'tcp'.*colocated.*gloo"):
        CheckpointEngineRegistry.new("tcp")
    assert {"colocated", "naive", "gloo", "nccl", "hccl"} <= set(CheckpointEngineRegistry.names())


def test_ranks_agree_on_buffers_or_fail_naming_both_values():
    """An explicit bucket size every rank shares wins; with none, the smallest that fits
    every rank (a trainer GPU nearly full must not pick a bigger bucket than its peer);
    a disagreement is one error naming the ranks and their values."""
    from weightbus.engines.base import agree_buffers
    meta = lambda size, fit, nb=2: {"bucket_size": size, "bucket_fit": fit, "num_buffers": nb}  # noqa: E731
    assert agree_buffers(1, [meta(None, 576 << 20), meta(None, 1 << 30)]) == 576 << 20
    assert agree_buffers(1, [meta(64 << 20, 64 << 20), meta(None, 1 << 30)]) == 64 << 20
    with pytest.raises(PlanError, match="bucket_size: trainer rank 0 has 1024, rollout rank 0 has 2048"):
        agree_buffers(1, [meta(1024, 1024), meta(2048, 2048)])
    with pytest.raises(PlanError, match="disagree on num_buffers: .*rollout rank 1 has 3"):
        agree_buffers(1, [meta(None, 4096), meta(None, 4096), meta(None, 4096, nb=3)])
