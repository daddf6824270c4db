"""Recording where a loader puts an update tensor's bytes (``weightbus.integrations.vllm
.placement``), without vLLM: loaders written the way vLLM's are (tensor-parallel slices,
fused q/k/v and gate/up pieces, an expert's slot, indexing, chunking, size-1 reshapes)
run once on tracked meta stand-ins, and the recorded regions, replayed into a real
parameter, must give exactly what the loader writes from the real tensor. A loader that
does more than place bytes must make its tensor a fallback, never a wrong placement."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightbus.integrations.placement import Recorder
from weightbus.packing.shards import Box
from weightbus.plan import Manifest, TensorMeta


def record(loaders, shapes, param_shape):
    """Run each ``loaders[name](param, weight)`` on tracked stand-ins; returns the
    placement, and the parameter the real loaders fill next to its replay."""
    rec, layer = Recorder(), torch.nn.Linear(1, 1)
    meta = torch.empty(param_shape, device="meta")
    for name, loader in loaders.items():
        w = rec.tracked(name, shapes[name], torch.float32)
        rec.loading(layer, "layer", "weight", meta, w, lambda loader=loader, w=w: loader(meta, w))
    manifest = Manifest([TensorMeta(n, torch.float32, s) for n, s in shapes.items()])
    placement = rec.result(manifest, lambda layer, param: None)
    g = torch.Generator().manual_seed(0)
    real = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    want = torch.full(param_shape, float("nan"))
    for name, loader in loaders.items():
        loader(want, real[name])
    got = torch.full(param_shape, float("nan"))
    for fill in placement.fills.get(layer, ()):  # (at the layer's materialization)
        fill.apply(got)
    for name, scatters in placement.scatters.items():
        for sc in scatters:
            sc.view(got).copy_(sc.box.of(real[name]))
    return placement, want, got


def same(a, b):
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def qkv_piece(offset, size):
    """q, k or v of rank 1 of TP=2 into its place in the fused parameter."""
    return lambda p, w: p.narrow(0, offset, size).copy_(w.narrow(0, size, size))


def expert(i):
    return lambda p, w: p[i].copy_(w[:, 2:])


CASES = {  # (loaders, update tensor shapes, parameter shape); rank 1 of TP=2 throughout
    "column-parallel": ({"w": lambda p, w: p.copy_(w.narrow(0, 4, 4))}, {"w": (8, 6)}, (4, 6)),
    "row-parallel": ({"w": lambda p, w: p.data.copy_(w.narrow(1, 3, 3))}, {"w": (8, 6)}, (8, 3)),
    "fused qkv": ({n: qkv_piece(o, s) for n, o, s in [("q", 0, 4), ("k", 4, 2), ("v", 6, 2)]},
                  {"q": (8, 5), "k": (4, 5), "v": (4, 5)}, (8, 5)),
    "gate/up by chunk": ({"gate": lambda p, w: p.chunk(2)[0].copy_(w.chunk(2, dim=0)[1]),
                          "up": lambda p, w: p.chunk(2)[1].copy_(w.chunk(2)[1])},
                         {"gate": (6, 4), "up": (6, 4)}, (6, 4)),
    "an expert's slot": ({f"e{i}": expert(i) for i in range(3)},
                         {f"e{i}": (5, 4) for i in range(3)}, (3, 5, 2)),
    "setitem and ellipsis": ({"w": lambda p, w: p.__setitem__((slice(1, 3), ...), w[..., 1:3, :])},
                             {"w": (4, 3)}, (4, 3)),
    "vocab slice with padding": ({"w": lambda p, w: p[:3].copy_(w.narrow(0, 5, 3))}, {"w": (8, 4)}, (4, 4)),
    "padding zeroed": ({"w": lambda p, w: (p[:3].copy_(w.narrow(0, 5, 3)), p[3:].data.fill_(0),
                                           p[4:].zero_())},  # (an empty fill too)
                       {"w": (8, 4)}, (4, 4)),
    "size-1 reshapes": ({"w": lambda p, w: p.copy_(w.view(1, 6).squeeze(0).unsqueeze(1).flatten())},
                        {"w": (6,)}, (6,)),
    "select then unsqueeze": ({"w": lambda p, w: p.copy_(w.select(0, 2).unsqueeze(0))},
                              {"w": (3, 4)}, (1, 4)),
    "split sections": ({"w": lambda p, w: p.copy_(w.split([1, 3], dim=1)[1].contiguous())},
                       {"w": (2, 4)}, (2, 3)),
    "unbind": ({"w": lambda p, w: p.copy_(w.unbind(0)[1])}, {"w": (2, 5)}, (5,)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recorded_regions_replay_what_the_loader_writes(case):
    loaders, shapes, param_shape = CASES[case]
    placement, want, got = record(loaders, shapes, param_shape)
    assert placement.fallbacks == {}, placement.fallbacks
    assert same(got, want)
    # and the layout names only what the loader keeps
    for name, boxes in placement.layout.boxes.items():
        assert sum(b.numel for b in boxes) <= torch.Size(shapes[name]).numel()


FALLBACKS = {  # a loader that does more than place bytes: its tensor arrives whole
    "transposed": (lambda p, w: p.copy_(w.t()), (4, 4), (4, 4), "computes on it"),
    "cast": (lambda p, w: p.copy_(w.to(torch.float16)), (4, 4), (4, 4), "computes on it"),
    "scaled": (lambda p, w: p.copy_(w * 2), (4, 4), (4, 4), "computes on it"),
    "copied first": (lambda p, w: p.copy_(w.clone()), (4, 4), (4, 4), "computes on it"),
    "broadcast": (lambda p, w: p.copy_(w), (4,), (3, 4), "broadcasts"),
    "scaled in place after": (lambda p, w: (p.copy_(w), p.mul_(2)), (4, 4), (4, 4), "writes into"),
    "copied twice": (lambda p, w: (p.copy_(w), p.copy_(p.flip(0))), (4, 4), (4, 4), "writes into"),
    "fills what it copies": (lambda p, w: (p.copy_(w), p[1].fill_(0)), (4, 4), (4, 4), "fills part of"),
    "stepped slice": (lambda p, w: p.copy_(w[::2]), (8, 4), (4, 4), "computes on it"),
    "mask indexing": (lambda p, w: p.copy_(w[torch.tensor([0, 2, 4, 6])]), (8, 4), (4, 4), "computes on it"),
    "into a temporary": (lambda p, w: p.copy_(torch.empty_like(p).copy_(w)), (4, 4), (4, 4),
                         "copies it into something other"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_a_loader_that_transforms_makes_a_fallback(case):
    loader, shape, param_shape, why = FALLBACKS[case]
    placement, _, _ = record({"w": loader}, {"w": shape}, param_shape)
    assert "w" in placement.fallbacks and why in placement.fallbacks["w"], placement.fallbacks
    assert "w" not in placement.layout.boxes and "w" not in placement.scatters  # wanted whole


def test_a_tensor_no_loader_copies_is_not_wanted():
    placement, _, _ = record({"w": lambda p, w: None}, {"w": (4, 4)}, (4, 4))
    assert placement.layout.boxes == {"w": ()} and placement.fallbacks == {}


def test_a_parameter_that_cannot_be_written_in_place_makes_its_tensors_fall_back():
    rec = Recorder()
    meta = torch.empty(4, device="meta")
    w = rec.tracked("w", (4,), torch.float32)
    rec.loading(torch.nn.Linear(1, 1), "attn", "k_scale", meta, w, lambda: meta.copy_(w))
    placement = rec.result(Manifest([TensorMeta("w", torch.float32, (4,))]),
                           lambda layer, param: "processed at the end")
    assert placement.fallbacks == {"w": "attn.k_scale: processed at the end"}


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_narrowed_regions_replay_exactly(data):
    """Random nested narrows and index slices of a 3-D tensor into a random region of a
    parameter: the replay equals the loader."""
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=3, max_size=3)))
    ops = data.draw(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5), st.integers(0, 5)),
                             max_size=4))

    def cut(t):
        for dim, a, n in ops:
            size = t.shape[dim]
            a = min(a, size - 1)
            t = t.narrow(dim, a, max(1, min(n, size - a)))
        return t

    region = tuple(cut(torch.empty(shape, device="meta")).shape)
    extra = data.draw(st.integers(0, 3))
    param_shape = (region[0] + extra, *region[1:])
    offset = data.draw(st.integers(0, extra))
    placement, want, got = record({"w": lambda p, w: p[offset:offset + region[0]].copy_(cut(w))},
                                  {"w": shape}, param_shape)
    assert placement.fallbacks == {} and same(got, want)


def test_box_helpers():
    a, b = Box((0, 2), (4, 4)), Box((2, 0), (4, 4))
    assert a.intersect(b) == Box((2, 2), (2, 2))
    assert a.intersect(Box((4, 0), (1, 1))) is None
    assert Box((2, 3), (1, 2)).within(a) == (slice(2, 3), slice(1, 3))
    assert a.overlaps(b) and not a.overlaps(Box((4, 0), (1, 1)))
    assert Box((2, 3), (1, 2)).inside(a) and not b.inside(a)
