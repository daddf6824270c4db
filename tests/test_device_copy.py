"""The GPU's copy list (weightbus/copy_triton.py): a table of chunks copied by one Triton
launch, bit for bit what ``dst.copy_(src)`` gives. On a GPU through ``CopyList`` as the
engines use it; without one, the same kernel under Triton's interpreter on host tensors."""

import os

import pytest
import torch

from weightbus import buffers

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter was not chosen (conftest.py sets "
                "TRITON_INTERPRET=1 where there is no GPU)", allow_module_level=True)

from weightbus.copy_triton import CHUNK, DeviceCopy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _copier(dsts):
    """What the engines use on a GPU (asserting it took the Triton path), the kernel itself
    on host tensors."""
    if DEVICE == "cuda":
        lst = buffers.CopyList(dsts)
        assert isinstance(lst._host, DeviceCopy)
        return lambda srcs: (lst.run(srcs), torch.cuda.synchronize())
    dc = DeviceCopy(dsts)
    return lambda srcs: dc.run(srcs) or pytest.fail("the table refused sources that fit")


def _float32_edges(n: int, gen: torch.Generator) -> torch.Tensor:
    """float32 values with every rounding case of a cast to bfloat16: ties to even both
    ways, values that round up into the next exponent, subnormals, infinities, zeros."""
    x = torch.randn(n, generator=gen)
    bits = x.view(torch.int32)
    bits[0::7] = (bits[0::7] & ~0xFFFF) | 0x8000  # exact ties
    bits[1::7] = (bits[1::7] & ~0xFFFF) | 0x18000  # ties with an odd bfloat16
    bits[2::7] = 0x3F7FFFFF  # rounds up to 1.0
    bits[3::11] = 0x00000001  # the smallest subnormal
    x[4::13] = float("inf")
    x[5::13] = float("-inf")
    x[6::17] = -0.0
    return x


def _pairs(gen: torch.Generator):
    """(source, destination) pairs over the lengths that cut chunks and 16-byte units at
    every edge, aligned and not, of every dtype pair the kernel copies."""
    lengths = [1, 3, 7, 8, 9, 4095, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 7]
    out = []
    for n in lengths:
        out.append((torch.randn(n, generator=gen).to(torch.bfloat16), torch.bfloat16))
        out.append((_float32_edges(n, gen), torch.bfloat16))
        out.append((torch.randn(n, generator=gen).to(torch.float16), torch.float32))
        out.append((torch.randint(-128, 127, (n,), generator=gen, dtype=torch.int8), torch.int8))
        out.append((torch.randint(-2**62, 2**62, (n,), generator=gen, dtype=torch.int64), torch.int64))
    out.append((torch.randn(6, 4, generator=gen), torch.float32))
    out.append((torch.rand(5, generator=gen) > 0.5, torch.bool))
    return out


def _views(specs, offset_elems):
    """Destinations as views into one flat buffer per dtype, each starting ``offset_elems``
    elements past the last (an offset of 1 leaves most of them unaligned)."""
    dsts = []
    for (src, dtype) in specs:
        flat = torch.zeros(src.numel() + offset_elems + 8, dtype=dtype, device=DEVICE)
        dsts.append(flat[offset_elems:offset_elems + src.numel()].view(src.shape))
    return dsts


@pytest.mark.parametrize("offset", [0, 1])
def test_each_pair_is_what_copy_gives_bit_for_bit(offset):
    gen = torch.Generator().manual_seed(offset)
    specs = _pairs(gen)
    srcs = []
    for src, _ in specs:  # (sources unaligned too: a view one element in)
        base = torch.zeros(src.numel() + 1, dtype=src.dtype, device=DEVICE)
        view = base[offset:offset + src.numel()].view(src.shape)
        view.copy_(src.to(DEVICE))
        srcs.append(view)
    dsts = _views(specs, offset)
    run = _copier(dsts)
    run(srcs)
    for k, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
        want = s.to(d.dtype)
        assert torch.equal(_bits(d), _bits(want)), f"pair {k}: {s.dtype}{list(s.shape)} -> {d.dtype}"


def test_a_nan_stays_a_nan():
    src = torch.tensor([float("nan"), -float("nan"), 1.0], device=DEVICE)
    dst = torch.zeros(3, dtype=torch.bfloat16, device=DEVICE)
    _copier([dst])([src])
    assert torch.isnan(dst[:2].float()).all() and dst[2].item() == 1.0


def test_sources_that_change_are_read_again():
    """The table is reused while the sources are the very tensors at the very addresses;
    new values in them are copied (it holds addresses, not bytes), and a source given new
    memory (``.data =``) or replaced by another tensor is tabled again."""
    gen = torch.Generator().manual_seed(3)
    srcs = [torch.randn(n, generator=gen).to(DEVICE) for n in (5, CHUNK + 3, 100)]
    dsts = [torch.empty(s.numel(), dtype=torch.bfloat16, device=DEVICE) for s in srcs]
    run = _copier(dsts)
    for step in range(4):
        if step == 1:
            srcs[0].add_(1.0)  # in place: the same table
        if step == 2:
            srcs[1].data = torch.randn(CHUNK + 3, generator=gen).to(DEVICE)  # new memory, same object
        if step == 3:
            srcs[2] = torch.randn(100, generator=gen).to(DEVICE)  # another tensor
        run(srcs)
        for s, d in zip(srcs, dsts, strict=True):
            assert torch.equal(_bits(d), _bits(s.to(torch.bfloat16))), f"step {step}"


def test_sources_that_do_not_fit_are_refused_before_a_byte_moves():
    dsts = [torch.zeros(8, dtype=torch.bfloat16, device=DEVICE), torch.zeros(4, device=DEVICE)]
    dc = DeviceCopy(dsts)
    ok = [torch.ones(8, dtype=torch.bfloat16, device=DEVICE), torch.ones(4, device=DEVICE)]
    for bad in ([ok[0], torch.ones(5, device=DEVICE)],  # another shape
                [ok[0], torch.ones(4, dtype=torch.float64, device=DEVICE)],  # a cast it leaves to torch
                [ok[0], torch.ones(8, device=DEVICE)[::2]]):  # not contiguous
        assert dc.run(bad) is False
        assert not dsts[0].any(), "a refused list wrote something"
    assert dc.run(ok) is True and dsts[0].all() and dsts[1].all()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so -0.0 and 0.0 differ, and a NaN equals itself)."""
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t
