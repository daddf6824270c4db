"""Property-based tests of the bucket plan (weightbus/plan.py) and of packing/unpacking
buckets (weightbus/packing/buffers.py), over random manifests, bucket sizes and sender counts."""

import math

import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from weightbus.packing.buffers import Assembler, Packer
from weightbus.plan import ALIGNMENT, TRAILER_BYTES, BucketPlan, Manifest, TensorMeta

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool, torch.uint8]
MIN_BUCKET = ALIGNMENT + TRAILER_BYTES
#: integer dtype of each itemsize: floats are compared through their bits (NaN, -0.0)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# derandomized: CI draws the same examples every run; no deadline: the first example of
# a run pays for torch's lazy initialisation
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------- strategies


@st.composite
def shapes(draw, max_numel):
    """0..3 dims of sizes 0..70 (zero-size tensors included), at most ``max_numel``
    elements, so that a manifest stays small enough to pack many times a second."""
    shape, room = [], max_numel
    for _ in range(draw(st.integers(0, 3))):
        d = draw(st.integers(0, min(70, room)))
        shape.append(d)
        room = room // d if d else max_numel  # a zero dim: the tensor is empty whatever follows
    return tuple(shape)


@st.composite
def manifests(draw, max_numel=4096, dtypes=tuple(DTYPES)):
    n = draw(st.integers(1, 40))
    names = draw(st.lists(st.text(min_size=1, max_size=10), min_size=n, max_size=n, unique=True))
    return Manifest([TensorMeta(name, draw(st.sampled_from(dtypes)), draw(shapes(max_numel)))
                     for name in names])


# small buckets half the time: tensors split over several buckets, many buckets a plan
bucket_sizes = st.one_of(st.integers(MIN_BUCKET, 1024), st.integers(MIN_BUCKET, 4096))
n_senders_st = st.integers(1, 5)


# ---------------------------------------------------------------------------- plan


@SETTINGS
@given(m=manifests(), bucket_size=bucket_sizes, n_senders=n_senders_st)
def test_chunks_cover_every_byte_once_and_stay_inside_their_bucket(m, bucket_size, n_senders):
    plan = BucketPlan(m, bucket_size, n_senders)
    capacity = bucket_size - TRAILER_BYTES
    chunks_of = [[] for _ in m]  # (bucket, chunk) of every tensor, in plan order
    last_index = -1
    for k, b in enumerate(plan.buckets):
        assert b.index == k
        assert b.owner == b.index % n_senders
        assert b.chunks, f"bucket {k} is empty"
        spans = []
        for c in b.chunks:
            meta = m[c.index]
            assert c.index >= last_index, "chunks follow the manifest's order"
            last_index = c.index
            assert c.dst_offset >= 0 and c.dst_offset + c.nbytes <= capacity
            assert c.nbytes % meta.itemsize == 0 and c.src_offset % meta.itemsize == 0
            if c.nbytes:
                assert c.dst_offset % ALIGNMENT == 0
                spans.append((c.dst_offset, c.dst_offset + c.nbytes))
            chunks_of[c.index].append((b, c))
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
            assert end <= start, f"chunks overlap in bucket {k}"
        assert b.used == max(c.dst_offset + c.nbytes for c in b.chunks) <= capacity
    assert last_index == len(m) - 1

    for i, meta in enumerate(m):
        pieces = chunks_of[i]
        assert pieces, meta.describe()
        if meta.nbytes == 0:  # one empty chunk: the receiver yields it from that bucket
            ((b, c),) = pieces
            assert (c.src_offset, c.nbytes) == (0, 0)
            assert plan.owners_of(i) == {b.owner}
            continue
        pos = 0
        for _, c in pieces:  # in order, no gap, no overlap, no empty piece
            assert c.src_offset == pos and c.nbytes > 0
            pos += c.nbytes
        assert pos == meta.nbytes
        assert plan.owners_of(i) == {b.owner for b, c in pieces if c.nbytes}

    assert sorted(b.index for r in range(n_senders) for b in plan.owned_by(r)) == list(range(len(plan)))
    assert plan.wire_bytes == sum(b.wire_bytes for b in plan.buckets)


@SETTINGS
@given(m=manifests(), slots=st.integers(MIN_BUCKET // 8, 4096 // 8), n_senders=n_senders_st)
def test_wire_bytes_fit_in_buckets_of_sizes_engines_accept(m, slots, n_senders):
    """Engines only take bucket sizes that are multiples of ALIGNMENT (config.bucket_size);
    the trailer fits in every multiple of 8 (its own alignment)."""
    bucket_size = slots * 8
    for b in BucketPlan(m, bucket_size, n_senders).buckets:
        assert b.trailer_offset % 8 == 0 and b.trailer_offset >= b.used
        assert b.wire_bytes <= bucket_size


@SETTINGS
@given(m=manifests(), bucket_size=bucket_sizes, n_senders=n_senders_st)
@example(m=Manifest([TensorMeta("a", torch.uint8, (257,))]), bucket_size=321, n_senders=1)
def test_wire_bytes_fit_in_buckets_of_any_size(m, bucket_size, n_senders):
    for b in BucketPlan(m, bucket_size, n_senders).buckets:
        assert b.wire_bytes <= bucket_size, (b, bucket_size)


# ---------------------------------------------------------------------------- determinism


_other_dtype = {d: DTYPES[(k + 1) % len(DTYPES)] for k, d in enumerate(DTYPES)}


@SETTINGS
@given(m=manifests(), bucket_size=bucket_sizes, n_senders=n_senders_st, data=st.data())
def test_equal_manifests_give_equal_plans_and_fingerprints(m, bucket_size, n_senders, data):
    again = Manifest([TensorMeta(t.name, t.dtype, tuple(t.shape)) for t in m])
    wired = Manifest.from_bytes(m.to_bytes())
    assert list(wired) == list(m)
    plan = BucketPlan(m, bucket_size, n_senders)
    for other in (again, wired):
        assert other.fingerprint == m.fingerprint and other == m
        assert BucketPlan(other, bucket_size, n_senders).buckets == plan.buckets
    # the layout does not depend on the number of senders, only the owners do
    other_n = BucketPlan(m, bucket_size, data.draw(n_senders_st, label="other n_senders"))
    assert [(b.chunks, b.used) for b in other_n.buckets] == [(b.chunks, b.used) for b in plan.buckets]

    # one tensor changed in its name, dtype or shape: another fingerprint
    i = data.draw(st.integers(0, len(m) - 1), label="changed tensor")
    t = m[i]
    what = data.draw(st.sampled_from(["name", "dtype", "shape"]), label="changed field")
    if what == "name":
        names = {u.name for u in m}
        name = data.draw(st.text(min_size=1, max_size=10).filter(lambda s: s not in names), label="name")
        new = TensorMeta(name, t.dtype, t.shape)
    elif what == "dtype":
        new = TensorMeta(t.name, _other_dtype[t.dtype], t.shape)
    else:
        new = TensorMeta(t.name, t.dtype,
                         data.draw(shapes(4096).filter(lambda s: s != t.shape), label="shape"))
    changed = Manifest([new if k == i else u for k, u in enumerate(m)])
    assert changed.fingerprint != m.fingerprint and changed != m
    assert m.first_difference(changed).startswith(f"at position {i}:")


# ---------------------------------------------------------------------------- round trip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()]) if t.dtype.is_floating_point else t


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...], g: torch.Generator,
                   raw_bits: bool, strided: bool) -> torch.Tensor:
    """Random contents; floats either normal-ish values or arbitrary bit patterns (NaNs
    with payloads, infinities, -0.0, subnormals); optionally a non-contiguous tensor."""
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) < 0.5
    elif dtype.is_floating_point and not raw_bits:
        t = (torch.randn(shape, generator=g) * 1e3).to(dtype)
    else:  # integers: any value; floats: any bit pattern
        n = math.prod(shape) * dtype.itemsize
        t = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)
    if strided and t.dim() >= 2:
        t = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, other strides
    return t


def _sources(draw, wire: Manifest, src_dtype=lambda d: d) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1), label="seed"))
    raw_bits = draw(st.booleans(), label="raw float bits")
    strided = draw(st.booleans(), label="non-contiguous sources")
    return [_random_tensor(src_dtype(t.dtype), t.shape, g, raw_bits, strided) for t in wire]


def _send_and_receive(plan: BucketPlan, packer: Packer, slots: list[torch.Tensor],
                      sources: list[torch.Tensor], destinations: dict[str, torch.Tensor] | None
                      ) -> dict[str, torch.Tensor]:
    """Pack every bucket into one of the slots, unpack it, and keep (a copy of) what comes
    out, in order."""
    asm = Assembler(plan, torch.device("cpu"), destinations)
    got: dict[str, torch.Tensor] = {}
    for b in plan.buckets:
        slot = slots[b.index % len(slots)]
        packer.pack_bucket(slot, b, [sources[c.index] for c in b.chunks])
        for name, t in asm.unpack(slot, b):
            assert name not in got, f"{name!r} yielded twice"
            if destinations is not None:
                assert t is destinations[name]
            got[name] = t.clone()  # a view of the slot lives until the slot is reused
    assert list(got) == [t.name for t in plan.manifest], "every tensor once, in order"
    return got


def _check_arrived(wire: Manifest, got: dict[str, torch.Tensor], expected: list[torch.Tensor],
                   any_nan: bool = False) -> None:
    """Bitwise equal; with ``any_nan``, a NaN matches any NaN (torch's own float32 ->
    bfloat16 cast writes 0x7FC0 or 0xFFFF for a NaN depending on the source's strides)."""
    for meta, want in zip(wire, expected, strict=True):
        t = got[meta.name]
        assert t.dtype == meta.dtype and tuple(t.shape) == meta.shape, meta.describe()
        if any_nan and t.dtype.is_floating_point:
            nan = want.isnan()
            assert torch.equal(t.isnan(), nan), meta.describe()
            t, want = t[~nan], want[~nan]
        assert torch.equal(_bits(t), _bits(want)), meta.describe()


@SETTINGS
@given(wire=manifests(max_numel=512), bucket_size=bucket_sizes, n_senders=n_senders_st, data=st.data())
def test_pack_then_unpack_is_bitwise_identity(wire, bucket_size, n_senders, data):
    plan = BucketPlan(wire, bucket_size, n_senders)
    packer = Packer(plan)
    slots = [torch.full((bucket_size,), 0xAB, dtype=torch.uint8) for _ in range(2)]
    # into views of the slots first, then (other values, the same slots) into destinations
    first = _sources(data.draw, wire)
    _check_arrived(wire, _send_and_receive(plan, packer, slots, first, None), first)
    second = _sources(data.draw, wire)
    dest = {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in wire}
    _check_arrived(wire, _send_and_receive(plan, packer, slots, second, dest), second)


@SETTINGS
@given(wire=manifests(max_numel=512, dtypes=(torch.float32,) * 4 + tuple(DTYPES)),
       bucket_size=bucket_sizes, n_senders=n_senders_st, data=st.data())
def test_float32_sources_cast_to_a_bfloat16_wire_dtype(wire, bucket_size, n_senders, data):
    """The manifest says bfloat16 where the source holds float32 (every bfloat16 tensor
    here): the cast happens in the pack and the receiver gets exactly
    ``src.to(torch.bfloat16)``; the other dtypes travel as they are, in the same buckets."""
    wire = Manifest([TensorMeta(t.name, torch.bfloat16 if t.dtype == torch.float32 else t.dtype, t.shape)
                     for t in wire])
    plan = BucketPlan(wire, bucket_size, n_senders)
    packer = Packer(plan)
    slots = [torch.full((bucket_size,), 0xAB, dtype=torch.uint8) for _ in range(2)]
    sources = _sources(data.draw, wire, lambda d: torch.float32 if d == torch.bfloat16 else d)
    expected = [s.to(t.dtype) for t, s in zip(wire, sources, strict=True)]
    _check_arrived(wire, _send_and_receive(plan, packer, slots, sources, None), expected, any_nan=True)
    dest = {t.name: torch.zeros(t.shape, dtype=t.dtype) for t in wire}
    _check_arrived(wire, _send_and_receive(plan, packer, slots, sources, dest), expected, any_nan=True)


# ---------------------------------------------------------------------------- homes


@st.composite
def held_manifests(draw):
    """A manifest whose tensors are held on some sender ranks only (pipeline stages and
    experts), in runs, as Megatron's are; None: any rank."""
    m, n = draw(manifests()), draw(st.integers(2, 5))
    homes, run = [], None
    for _ in m:
        if run is None or draw(st.integers(0, 3)) == 0:
            run = draw(st.one_of(st.none(), st.frozensets(st.integers(0, n - 1), min_size=1)))
        homes.append(run)
    return Manifest(m.metas, homes), n


@SETTINGS
@given(mn=held_manifests(), bucket_size=bucket_sizes)
def test_homes_every_bucket_packed_where_all_its_tensors_are_held(mn, bucket_size):
    m, n = mn
    plan = BucketPlan(m, bucket_size, n)
    turns = [0] * n
    for b in plan.buckets:
        assert b.turn == turns[b.owner]  # slots cycle by it: consecutive per owner
        turns[b.owner] += 1
        for c in b.chunks:
            if c.nbytes and m.homes is not None and m.homes[c.index] is not None:
                assert b.owner in m.homes[c.index], (b, m.homes[c.index])
    # the bytes are the same as without homes, only cut at other places
    wired = Manifest.from_bytes(m.to_bytes())
    assert wired.homes == m.homes and wired.fingerprint == m.fingerprint
    assert BucketPlan(wired, bucket_size, n).buckets == plan.buckets
    assert m.same_tensors(Manifest(m.metas))
    if m.homes is not None:
        assert m.fingerprint != Manifest(m.metas).fingerprint  # the plan differs: so must the header


def test_homes_balance_and_keep_a_split_tensor_with_one_owner():
    f32 = torch.float32
    # every tensor held by ranks 0 and 1: the bytes split evenly, a split tensor whole on one
    m = Manifest([TensorMeta("big", f32, (5000,))] + [TensorMeta(f"t{i}", f32, (1000,)) for i in range(8)],
                 homes=[{0, 1}] * 9)
    plan = BucketPlan(m, 4096 + TRAILER_BYTES, 2)
    load = [sum(b.used for b in plan.buckets if b.owner == r) for r in (0, 1)]
    assert abs(load[0] - load[1]) <= 4000, load
    assert len(plan.owners_of(0)) == 1
    # two stages: the bucket where they meet closes early, each stage packs its own
    m = Manifest([TensorMeta(f"s{i}", f32, (100,)) for i in range(6)], homes=[{0}] * 3 + [{1}] * 3)
    plan = BucketPlan(m, 1 << 16, 2)
    assert [(b.owner, [c.index for c in b.chunks]) for b in plan.buckets] == [(0, [0, 1, 2]), (1, [3, 4, 5])]
    # the tensors of one fused parameter (a unit) stay with one packer over a bucket boundary
    m = Manifest([TensorMeta("pad", f32, (900,)), TensorMeta("gate", f32, (1000,)),
                  TensorMeta("up", f32, (1000,))], homes=[{0, 1}] * 3, units=[0, 1, 1])
    plan = BucketPlan(m, 4096 + TRAILER_BYTES, 2)
    assert len(plan) == 3 and plan.owners_of(1) == plan.owners_of(2)
    assert Manifest.from_bytes(m.to_bytes()).units == m.units
    # one sender (colocated): homes do not matter
    assert [b.owner for b in BucketPlan(m, 1 << 16, 1).buckets] == [0]
