"""The GPU's copy list (weightbus/packing/copy_triton.py): a table of chunks copied by one Triton
launch, bit for bit the sources. On a GPU through ``CopyList`` as the
engines use it; without one, the same kernel under Triton's interpreter on host tensors."""

import os

import pytest
import torch

from weightbus.packing import buffers

triton = pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU, and Triton's interpreter was not chosen (conftest.py sets "
                "TRITON_INTERPRET=1 where there is no GPU)", allow_module_level=True)

from weightbus.packing.copy_triton import CHUNK_BYTES, DeviceCopy  # noqa: E402

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


def _pairs(gen: torch.Generator):
    """Sources of every width the kernel copies, over the lengths that cut chunks and
    16-byte units at every edge; floats with the bit patterns a cast would disturb (NaN
    payloads, -0.0, subnormals): a copy keeps them."""
    out = []
    for dtype in (torch.bfloat16, torch.float32, torch.int8, torch.int64):
        chunk = CHUNK_BYTES // dtype.itemsize
        for n in (1, 3, 7, 8, 9, 4095, chunk - 1, chunk, chunk + 1, 2 * chunk + 7):
            raw = torch.randint(0, 255, (n * dtype.itemsize,), generator=gen, dtype=torch.uint8)
            out.append(raw.view(dtype))  # (random bits: NaNs of every payload among the floats)
    out.append(torch.randn(6, 4, generator=gen))
    out.append(torch.rand(5, generator=gen) > 0.5)
    return out


def _views(specs, offset_elems):
    """Destinations as views into a flat buffer each, ``offset_elems`` elements in (an
    offset of 1 leaves most of them unaligned)."""
    dsts = []
    for src in specs:
        flat = torch.zeros(src.numel() + offset_elems + 8, dtype=src.dtype, device=DEVICE)
        dsts.append(flat[offset_elems:offset_elems + src.numel()].view(src.shape))
    return dsts


@pytest.mark.parametrize("offset", [0, 1])
def test_each_pair_is_what_copy_gives_bit_for_bit(offset):
    gen = torch.Generator().manual_seed(offset)
    specs = _pairs(gen)
    srcs = []
    for src in specs:  # (sources unaligned too: a view one element in)
        base = torch.zeros(src.numel() + 1, dtype=src.dtype, device=DEVICE)
        view = base[offset:offset + src.numel()].view(src.shape)
        view.copy_(src.to(DEVICE))
        srcs.append(view)
    dsts = _views(specs, offset)
    run = _copier(dsts)
    run(srcs)
    for k, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
        assert torch.equal(_bits(d), _bits(s)), f"pair {k}: {s.dtype}{list(s.shape)}"


def _float32_edges(n: int, gen: torch.Generator) -> torch.Tensor:
    """float32 values whose bfloat16 rounding is at stake: random bits (NaNs of every payload,
    subnormals), halfway cases of both parities, values that round up to infinity."""
    x = torch.randint(-2**31, 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32)
    x[1::7] = (x[1::7] & ~0xFFFF) | 0x8000  # exactly halfway: ties to even
    x[2::11] = 0x7F7FFFFF  # the largest float32: rounds to infinity
    x[3::13] = 0x7F800000  # infinity
    x[4::17] = -0x80000000  # -0.0
    x[5::19] = 0x7F800001  # a signalling NaN
    return x.view(torch.float32)


@pytest.mark.parametrize("offset", [0, 1])
def test_float32_onto_bfloat16_rounds_as_torch(offset):
    """The one cast tabled (a float32 trainer's weights onto a bfloat16 wire): each value as
    torch's cast gives it, bit for bit; a NaN a quiet NaN of its sign. Lengths that cut chunks
    and 16-byte units at every edge, sources and destinations aligned and not, one launch."""
    gen = torch.Generator().manual_seed(7 + offset)
    chunk = CHUNK_BYTES // 4
    lengths = (1, 3, 7, 8, 9, 4095, chunk - 1, chunk, chunk + 1, 2 * chunk + 7)
    specs = [_float32_edges(n, gen) for n in lengths]
    srcs = []
    for x in specs:
        base = torch.zeros(x.numel() + 1, device=DEVICE)
        srcs.append(base[offset:offset + x.numel()])
        srcs[-1].copy_(x.to(DEVICE))
    dsts = [torch.zeros(x.numel() + offset + 8, dtype=torch.bfloat16, device=DEVICE)
            [offset:offset + x.numel()] for x in specs]
    run = _copier(dsts)
    run(srcs)
    for k, (s, d) in enumerate(zip(srcs, dsts, strict=True)):
        nan = torch.isnan(s)
        want = s.to(torch.bfloat16)
        assert torch.equal(_bits(d[~nan]), _bits(want[~nan])), f"pair {k} ({s.numel()} elements)"
        got = d[nan].view(torch.int16)
        assert torch.isnan(d[nan]).all() and torch.equal(got < 0, s[nan].view(torch.int32) < 0), f"pair {k}"
        assert ((got & 0x40) != 0).all(), f"pair {k}: a NaN came out signalling"


def test_other_casts_are_left_to_torch():
    """A cast other than float32 -> bfloat16 goes through torch's multi-tensor copy: refused
    by the table at once, every call, and still copied by the list."""
    for src_dtype, dst_dtype in ((torch.float64, torch.bfloat16), (torch.bfloat16, torch.float32),
                                 (torch.float32, torch.float16)):
        src = [torch.randn(100, device=DEVICE).to(src_dtype), torch.randn(7, device=DEVICE).to(src_dtype)]
        dsts = [torch.zeros(n, dtype=dst_dtype, device=DEVICE) for n in (100, 7)]
        dc = DeviceCopy(dsts)
        assert dc.run(src) is False and dc.run(src) is False
        buffers.CopyList(dsts).run(src)
        assert all(torch.equal(d, s.to(dst_dtype)) for s, d in zip(src, dsts, strict=True))


def test_sources_that_change_are_read_again():
    """The table is reused while the sources are the very tensors at the very addresses;
    new values in them are copied (it holds addresses, not bytes), and a source given new
    memory (``.data =``) or replaced by another tensor is tabled again."""
    gen = torch.Generator().manual_seed(3)
    n1 = CHUNK_BYTES // 4 + 3
    srcs = [torch.randn(n, generator=gen).to(DEVICE) for n in (5, n1, 100)]
    dsts = [torch.empty(s.numel(), device=DEVICE) for s in srcs]
    run = _copier(dsts)
    for step in range(4):
        if step == 1:
            srcs[0].add_(1.0)  # in place: the same table
        if step == 2:
            srcs[1].data = torch.randn(n1, generator=gen).to(DEVICE)  # new memory, same object
        if step == 3:
            srcs[2] = torch.randn(100, generator=gen).to(DEVICE)  # another tensor
        run(srcs)
        for s, d in zip(srcs, dsts, strict=True):
            assert torch.equal(_bits(d), _bits(s)), f"step {step}"


def test_sources_that_do_not_fit_are_refused_before_a_byte_moves():
    dsts = [torch.zeros(8, dtype=torch.bfloat16, device=DEVICE), torch.zeros(4, device=DEVICE)]
    dc = DeviceCopy(dsts)
    ok = [torch.ones(8, dtype=torch.bfloat16, device=DEVICE), torch.ones(4, device=DEVICE)]
    for bad in ([ok[0], torch.ones(5, device=DEVICE)],  # another shape
                [ok[0], torch.ones(4, dtype=torch.float64, device=DEVICE)],  # a cast left to torch
                [ok[0], torch.ones(8, device=DEVICE)[::2]]):  # not contiguous
        assert dc.run(bad) is False
        assert not dsts[0].any(), "a refused list wrote something"
    assert dc.run(ok) is True and dsts[0].all() and dsts[1].all()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so -0.0 and 0.0 differ, and a NaN equals itself)."""
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t
