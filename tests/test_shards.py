"""The sharded-receive schedule as a pure function (hypothesis): random manifests, random
layouts per rollout rank, bucket sizes and sender counts. Every element a receiver keeps
is written exactly once, from a sender that holds its tensor, and nothing else arrives;
bytes laid out by the plan and read back by it equal the regions, bit for bit."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbus.errors import PlanError
from weightbus.packing.shards import Box, ShardLayout, ShardPlan
from weightbus.plan import ALIGNMENT, Manifest, TensorMeta

DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float64]


@st.composite
def cases(draw):
    n = draw(st.integers(1, 6))
    shapes = [tuple(draw(st.lists(st.integers(1, 9), min_size=0, max_size=3))) for _ in range(n)]
    metas = [TensorMeta(f"t{i}", draw(st.sampled_from(DTYPES)), s) for i, s in enumerate(shapes)]
    senders = draw(st.integers(1, 3))
    homes = None
    if senders > 1 and draw(st.booleans()):
        homes = [draw(st.sets(st.integers(0, senders - 1), min_size=1)) for _ in range(n)]
    manifest = Manifest(metas, homes=homes)
    layouts = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.booleans()):
            layouts.append(None)  # this rank takes everything whole
            continue
        boxes = {}
        for m in metas:
            how = draw(st.sampled_from(["whole", "none", "cut"]))
            if how == "none":
                boxes[m.name] = []
            elif how == "cut" and m.shape:
                d = draw(st.integers(0, len(m.shape) - 1))
                n = m.shape[d]
                cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else []
                edges = [0, *cuts, m.shape[d]]
                keep = [Box.rows(m.shape, a, b, dim=d) for a, b in zip(edges, edges[1:], strict=False)
                        if draw(st.booleans())]
                boxes[m.name] = keep
        layouts.append(ShardLayout(boxes))
    bucket = draw(st.sampled_from([320, 512, 1024, 4096]))
    return manifest, layouts, bucket, senders


def _wanted(manifest, layout, r):
    masks = [torch.zeros(m.shape, dtype=torch.int32) for m in manifest.metas]
    for i, box in (layout or ShardLayout({})).wants(manifest, r):
        box.of(masks[i]).add_(1)
    return masks


@settings(max_examples=300, deadline=None)
@given(cases())
def test_every_kept_element_arrives_once_from_a_holder(case):
    manifest, layouts, bucket, senders = case
    plan = ShardPlan(manifest, layouts, bucket, senders)
    capacity = (bucket - 64) // 8 * 8
    for r, layout in enumerate(layouts):
        want = _wanted(manifest, layout, r)
        got = [torch.zeros(m.shape, dtype=torch.int32) for m in manifest.metas]
        for seq, b in enumerate(plan.received_by(r)):
            assert b.receiver == r and b.seq == seq
            end = 0
            for p in b.pieces:
                m = manifest[p.tensor]
                assert p.offset % ALIGNMENT == 0 and p.offset >= end, "pieces overlap or misalign"
                assert p.nbytes == p.box.numel * m.dtype.itemsize
                end = p.offset + p.nbytes
                p.box.check(m.shape, m.name)
                p.box.of(got[p.tensor]).add_(1)
                homes = manifest.homes[p.tensor] if manifest.homes and senders > 1 else None
                assert homes is None or b.owner in homes, "sent by a rank that does not hold it"
                assert p.tensor in plan.tensors_of(b.owner)
            assert end == b.used <= capacity
        for i, m in enumerate(manifest.metas):
            assert torch.equal(got[i], want[i]), (r, m.name)  # once each, nothing extra
        assert plan.bytes_for(r) == sum(int(w.sum()) * m.dtype.itemsize
                                        for w, m in zip(want, manifest.metas, strict=True))
    for s in range(senders):
        assert [b.turn for b in plan.sent_by(s)] == list(range(len(plan.sent_by(s))))
    assert plan.fallbacks == [sum(1 for m in manifest.metas if lay is None or m.name not in lay.boxes)
                              for lay in layouts]


@settings(max_examples=100, deadline=None)
@given(cases())
def test_bytes_through_the_plan_equal_the_regions(case):
    """Pack every bucket from real tensors at the plan's offsets, read it back on the
    receiver's side into zeroed copies: each kept region equals the source, bitwise."""
    manifest, layouts, bucket, senders = case
    plan = ShardPlan(manifest, layouts, bucket, senders)
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(-100, 100, m.shape, generator=g).to(m.dtype) for m in manifest.metas]
    for r, layout in enumerate(layouts):
        dst = [torch.zeros_like(t) for t in src]
        for b in plan.received_by(r):
            buf = torch.zeros(bucket, dtype=torch.uint8)
            for p in b.pieces:  # the sender
                buf[p.offset:p.offset + p.nbytes].copy_(p.box.of(src[p.tensor]).contiguous().view(-1)
                                                        .view(torch.uint8))
            for p in b.pieces:  # the receiver
                view = buf[p.offset:p.offset + p.nbytes].view(manifest[p.tensor].dtype)
                p.box.of(dst[p.tensor]).copy_(view.view(p.box.size))
        want = _wanted(manifest, layout, r)
        for i in range(len(src)):
            assert torch.equal(dst[i] * want[i].to(dst[i].dtype), src[i] * want[i].to(src[i].dtype))


@given(cases())
def test_layouts_travel_as_bytes(case):
    _, layouts, _, _ = case
    for lay in layouts:
        if lay is not None:
            back = ShardLayout.from_bytes(lay.to_bytes())
            assert back.boxes == lay.boxes and back.fingerprint == lay.fingerprint


def test_bad_layouts_are_named():
    m = Manifest([TensorMeta("w", torch.float32, (4, 6))])
    with pytest.raises(PlanError, match=r"rollout rank 1, tensor 'w': region \[0:5, 0:6\] does not fit"):
        ShardPlan(m, [None, ShardLayout({"w": [Box.rows((4, 6), 0, 5)]})], 1024, 1)
    with pytest.raises(PlanError, match="overlap"):
        ShardPlan(m, [ShardLayout({"w": [Box.rows((4, 6), 0, 3), Box.rows((4, 6), 2, 4)]})], 1024, 1)
    with pytest.raises(PlanError, match="does not fit"):
        ShardPlan(m, [ShardLayout({"w": [Box((0,), (4,))]})], 1024, 1)  # rank mismatch


def test_a_tensor_goes_to_one_sender_and_senders_share_the_bytes():
    metas = [TensorMeta(f"w{i}", torch.float32, (64, 64)) for i in range(6)]
    layouts = [ShardLayout({m.name: [Box.rows(m.shape, 32 * r, 32 * r + 32)] for m in metas})
               for r in range(2)]
    plan = ShardPlan(Manifest(metas), layouts, 1 << 20, 3)
    assert sorted(plan.senders) == [0, 0, 1, 1, 2, 2]
    assert plan.bytes_for(0) == plan.bytes_for(1) == 6 * 32 * 64 * 4  # half of each tensor
    assert plan.fallbacks == [0, 0]
