"""Delta mode's encoding, in one process: every record kind round-trips bitwise into the
receiver's tensors, the C kernels make the same records as the torch path and write the same
bits, the GPU grouping finds the same changes as the per-piece diff, and a corrupt or
misplaced patch is caught naming the tensor. (Across processes, with real
optimizer steps and FSDP2 shards: tests/test_engines.py and tests/test_manager.py.)"""

import os

import pytest
import torch

from weightbus.engines.delta import cpu as kernels
from weightbus.engines.delta import encoding as drec
from weightbus.engines.delta import gpu
from weightbus.engines.delta import receiver as dr
from weightbus.engines.delta import sender as ds
from weightbus.plan import Manifest, TensorMeta

SHAPES = [("a", (300, 7)), ("b", (5,)), ("c", (4096,)), ("d", (1,))]


def _setup(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(s, generator=g).to(dtype) for _, s in SHAPES]
    manifest = Manifest(TensorMeta(n, dtype, s) for n, s in SHAPES)
    return weights, manifest


def _bf16_model(shapes, seed):
    """bf16 weights of ``shapes``, their manifest, a trainer's snapshots, zeroed targets."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(s, generator=g).to(torch.bfloat16) for _, s in shapes]
    manifest = Manifest(TensorMeta(n, torch.bfloat16, s) for n, s in shapes)
    return weights, manifest, ds.Snapshots(), [torch.zeros_like(w).view(-1) for w in weights]


def _one_percent_patches():
    """The weights of ``_setup``, their manifest, targets holding them (a full update), and
    the records of 1 % of their elements changed."""
    weights, manifest = _setup()
    snaps = ds.Snapshots()
    targets = [torch.zeros_like(w).view(-1) for w in weights]
    _deliver(ds.records(_pieces(weights), manifest, snaps, True, 1 << 20), targets, manifest, True)
    _mutate(weights, 0.01, 1)
    return weights, manifest, targets, ds.records(_pieces(weights), manifest, snaps, False, 1 << 20)


def _pieces(weights):
    for i, w in enumerate(weights):
        yield i, 0, w.view(-1)


def _mutate(weights, fraction, seed):
    g = torch.Generator().manual_seed(seed)
    for w in weights:
        flat = w.view(-1)
        k = max(1, round(flat.numel() * fraction))
        idx = torch.randint(0, flat.numel(), (k,), generator=g)
        drec._bits(flat)[idx] += 1


def _deliver(recs, targets, manifest, full):
    slot = torch.zeros(8 + sum(r.size for r in recs), dtype=torch.uint8, device=targets[0].device)
    ds._fill(slot, recs)
    return dr._apply(slot, slot.numel(), targets, manifest, full)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_round_trip_every_kind(dtype):
    weights, manifest = _setup(dtype)
    snaps = ds.Snapshots()
    targets = [torch.zeros_like(w).view(-1) for w in weights]
    _deliver(ds.records(_pieces(weights), manifest, snaps, True, 1 << 20), targets, manifest, True)
    kinds = set()
    for step, fraction in enumerate([0.001, 0.02, 0.2, 0.9]):
        _mutate(weights, fraction, step)
        recs = ds.records(_pieces(weights), manifest, snaps, False, 1 << 20)
        kinds |= {r.head[1] for r in recs}
        _deliver(recs, targets, manifest, False)
        for w, t in zip(weights, targets, strict=True):
            assert torch.equal(drec._bits(w.view(-1)), drec._bits(t))  # bitwise
    assert kinds == {drec.SPARSE, drec.BITMAP, drec.DENSE}  # each encoding chosen where it is smallest


def test_small_buckets_split_records():
    weights, manifest = _setup()
    recs = ds.records(_pieces(weights), manifest, ds.Snapshots(), True, 1024)
    assert max(r.size for r in recs) <= 1024 and len(recs) > len(weights)


def test_grouped_diff_finds_the_same_changes():
    """What a GPU does (every piece's mask side by side, one nonzero), checked on the CPU."""
    weights, manifest = _setup()
    snaps = [w.view(-1).clone() for w in weights]
    _mutate(weights, 0.05, 7)
    group = ds._Batch()
    for i, (w, s) in enumerate(zip(weights, snaps, strict=True)):
        group.add(i, 0, w.view(-1), s.clone(), w.numel(), w.element_size())
    grouped = list(ds._encode_group(group))
    single = [ds.encode(i, 0, w.view(-1), s.clone(), False) for i, (w, s) in enumerate(zip(weights, snaps,
                                                                                          strict=True))]
    single = [r for r in single if r is not None]
    assert [r.head for r in grouped] == [r.head for r in single]
    assert all(torch.equal(a, b) for x, y in zip(grouped, single, strict=True) for a, b in zip(x.body, y.body,
                                                                                                strict=True))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
@pytest.mark.parametrize("n", [1, 3, 4, 7, 1000, 4099])
def test_changed_positions(dtype, n):
    a = (torch.randn(n) * 10).to(dtype)
    b = a.clone()
    drec._bits(b)[torch.randint(0, n, (max(1, n // 10),))] += 1
    for sl in (slice(None), slice(1, None)):  # aligned, and not 8-byte aligned
        want = (drec._bits(b)[sl] != drec._bits(a)[sl]).nonzero().squeeze(1)
        assert torch.equal(drec._changed(drec._bits(b)[sl], drec._bits(a)[sl]).sort().values, want)


def _as_on_a_gpu(monkeypatch):
    """Host tensors through the GPU's path: grouped, diffed and patched by the Triton kernels
    run by Triton's interpreter (CI has no GPU; the kernels are the ones a GPU compiles)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU runs the compiled kernels (test_gpu_kernels_on_cuda): Triton cannot also "
                    "interpret them in this process")
    if os.environ.get("TRITON_INTERPRET") != "1":  # (conftest.py sets it where there is no GPU)
        pytest.skip("Triton's interpreter is chosen as Triton is imported: TRITON_INTERPRET=1 was not set")
    pytest.importorskip("triton")
    monkeypatch.setattr(gpu, "_kernels", None)
    monkeypatch.setattr(gpu, "_tried", False)
    monkeypatch.setattr(kernels, "usable", lambda *tensors: None)
    monkeypatch.setattr(gpu, "usable", lambda *tensors: gpu.kernels())
    monkeypatch.setattr(ds, "_grouped", lambda t: True)
    assert gpu.kernels() is not None


@pytest.fixture(params=["kernels", "torch", "triton"])
def path(request, monkeypatch):
    """Every way a tensor is diffed and patched: the C kernels, torch's ops, and the GPU's
    Triton kernels."""
    if request.param == "kernels":
        assert kernels.library() is not None, "the C kernels did not build (is there a C compiler?)"
    elif request.param == "torch":
        monkeypatch.setattr(kernels, "usable", lambda *tensors: None)
    else:
        _as_on_a_gpu(monkeypatch)
    return request.param


DTYPES = [torch.uint8, torch.bfloat16, torch.float32, torch.float64]


def _records_both(weights, manifest, snaps_k, snaps_t, full, capacity):
    """The same pieces through the kernels and through torch (each with its own snapshots)."""
    got = ds.records(_pieces(weights), manifest, snaps_k, full, capacity)
    real = kernels.usable
    try:
        kernels.usable = lambda *tensors: None
        want = ds.records(_pieces(weights), manifest, snaps_t, full, capacity)
    finally:
        kernels.usable = real
    return got, want


def _body(r):
    return torch.cat([p for p in r.body])


def _same_records(got, want):
    """Two paths' records the same, bit for bit: headers, digests, bodies with their padding
    (order is free: in a batch the kernels' dense records come after the others). Returns
    their kinds."""
    got, want = (sorted(x, key=lambda r: (r.head[0], r.head[2])) for x in (got, want))
    assert [r.head + [r.digest] for r in got] == [r.head + [r.digest] for r in want]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(_body(a), _body(b)), a.head
    return {r.head[1] for r in got}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("capacity, batch", [(1 << 20, None), (1000, None), (1 << 20, 700)])
def test_kernels_make_the_records_torch_makes(dtype, capacity, batch, monkeypatch):
    """The C kernels' records and snapshots are the torch path's, bit for bit (capacity
    1000: records split mid-word, unaligned; batch 700: many calls in flight on threads)."""
    if batch is not None:
        monkeypatch.setattr(ds, "_BATCH", batch)
        monkeypatch.setenv("WEIGHTBUS_DELTA_THREADS", "2")
    shapes = [("a", (300, 7)), ("b", (5,)), ("c", (4099,)), ("d", (1,)), ("e", (64, 33))]
    g = torch.Generator().manual_seed(3)
    weights = [(torch.randn(s, generator=g) * 20).to(dtype) for _, s in shapes]
    manifest = Manifest(TensorMeta(n, dtype, s) for n, s in shapes)
    sk, st = ds.Snapshots(), ds.Snapshots()
    _records_both(weights, manifest, sk, st, True, capacity)
    kinds = set()
    for step, fraction in enumerate([0.0005, 0.01, 0.05, 0.3, 0.95]):
        _mutate(weights, fraction, 10 + step)
        kinds |= _same_records(*_records_both(weights, manifest, sk, st, False, capacity))
        assert all(torch.equal(sk.pieces[key], st.pieces[key]) for key in st.pieces)  # snapshots too
    assert {drec.SPARSE, drec.BITMAP, drec.DENSE} <= kinds


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("capacity, group", [(1 << 20, None), (1000, None), (1 << 20, 5000)])
def test_gpu_kernels_make_the_records_torch_makes(dtype, capacity, group, monkeypatch):
    """The Triton kernels' records (kinds, digests, bodies with their padding) and snapshots
    are the torch path's, bit for bit (also with many groups in flight at once)."""
    if group is not None:
        monkeypatch.setattr(ds, "_GROUP", group)
    # (pieces of whole blocks only, whole blocks and a partial one, a partial one only)
    shapes = [("a", (300, 7)), ("b", (5,)), ("c", (9001,)), ("d", (1,)), ("e", (64, 33)), ("f", (2, 4096))]
    if capacity < 4096:  # records of a few hundred elements hold no whole block: smaller tensors
        # split as often (the interpreter runs a program per record: 171 per step in fp64)
        shapes = [("a", (30, 7)), ("b", (5,)), ("c", (1001,)), ("d", (1,)), ("e", (16, 33)), ("f", (2, 512))]
    g = torch.Generator().manual_seed(4)
    weights = [(torch.randn(s, generator=g) * 20).to(dtype) for _, s in shapes]
    manifest = Manifest(TensorMeta(n, dtype, s) for n, s in shapes)
    sk, st = ds.Snapshots(), ds.Snapshots()
    want = [ds.records(_pieces(weights), manifest, st, True, capacity)]
    with monkeypatch.context() as m:
        _as_on_a_gpu(m)
        got = [ds.records(_pieces(weights), manifest, sk, True, capacity)]
    kinds = set()
    # (three steps, each kind at least once: the interpreter runs a program per record)
    for step, fraction in enumerate([0.0005, 0.05, 0.95]):
        _mutate(weights, fraction, 20 + step)
        with monkeypatch.context() as m:
            m.setattr(kernels, "usable", lambda *tensors: None)
            want = ds.records(_pieces(weights), manifest, st, False, capacity)
        with monkeypatch.context() as m:
            _as_on_a_gpu(m)
            got = ds.records(_pieces(weights), manifest, sk, False, capacity)
        kinds |= _same_records(got, want)
        assert all(torch.equal(sk.pieces[key], st.pieces[key]) for key in st.pieces)
    assert {drec.SPARSE, drec.BITMAP, drec.DENSE} <= kinds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (the interpreter covers the logic)")
def test_gpu_kernels_on_cuda(monkeypatch):
    """On a GPU, compiled: the Triton kernels' records are the torch path's (a model of two
    element sizes, records split between buckets), land bitwise, and a corrupt value is
    named."""
    assert gpu.kernels() is not None, "no Triton on this GPU machine"
    shapes = [("a", (300, 7)), ("b", (5,)), ("c", (9001,)), ("d", (1,)), ("e", (64, 33)), ("f", (70000,))]
    dtypes = [torch.bfloat16, torch.float32, torch.bfloat16, torch.uint8, torch.float64, torch.bfloat16]
    g = torch.Generator(device="cuda").manual_seed(4)
    weights = [(torch.randn(s, generator=g, device="cuda") * 20).to(d) for (_, s), d in zip(shapes, dtypes,
                                                                                             strict=True)]
    manifest = Manifest(TensorMeta(n, d, s) for (n, s), d in zip(shapes, dtypes, strict=True))
    sk, st = ds.Snapshots(), ds.Snapshots()
    targets = [torch.zeros_like(w).view(-1) for w in weights]
    _deliver(ds.records(_pieces(weights), manifest, sk, True, 1 << 20), targets, manifest, True)
    ds.records(_pieces(weights), manifest, st, True, 1 << 20)
    kinds = set()
    for fraction in [0.0005, 0.01, 0.05, 0.3, 0.95]:
        for w in weights:
            flat = drec._bits(w.view(-1))
            flat[torch.randint(0, flat.numel(), (max(1, round(flat.numel() * fraction)),), device="cuda",
                               generator=g)] += 1
        got = ds.records(_pieces(weights), manifest, sk, False, 5000)
        with monkeypatch.context() as m:
            m.setattr(gpu, "usable", lambda *tensors: None)
            want = ds.records(_pieces(weights), manifest, st, False, 5000)
        kinds |= _same_records(got, want)
        _deliver(got, targets, manifest, False)
        assert all(torch.equal(drec._bits(w.view(-1)), drec._bits(t))
                   for w, t in zip(weights, targets, strict=True))
    assert {drec.SPARSE, drec.BITMAP, drec.DENSE} <= kinds
    drec._bits(weights[5].view(-1))[[3, 5000, 60000]] += 1
    recs = ds.records(_pieces(weights), manifest, sk, False, 5000)  # (the capacity the snapshots were cut by)
    assert [r.head[:2] for r in recs] == [[5, drec.SPARSE]] * 3
    recs[0].body = [_body(recs[0])]
    recs[0].body[0][-8] ^= 1  # (a byte of its values)
    with pytest.raises(dr._Drift, match="tensor 'f': elements .* do not match the trainer's"):
        _deliver(recs, targets, manifest, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kind_lands_bitwise_either_way(dtype, path):
    # (records of 999 bytes: a tensor spans many; a third of these elements split as often,
    # and Triton's interpreter runs a program per record)
    shapes = [("a", (100, 7)), ("b", (5,)), ("c", (1027,)), ("d", (1,))]
    g = torch.Generator().manual_seed(5)
    weights = [(torch.randn(s, generator=g) * 20).to(dtype) for _, s in shapes]
    manifest = Manifest(TensorMeta(n, dtype, s) for n, s in shapes)
    snaps = ds.Snapshots()
    targets = [torch.zeros_like(w).view(-1) for w in weights]
    _deliver(ds.records(_pieces(weights), manifest, snaps, True, 1 << 20), targets, manifest, True)
    for step, fraction in enumerate([0.001, 0.02, 0.2, 0.9]):
        _mutate(weights, fraction, step)
        recs = ds.records(_pieces(weights), manifest, snaps, False, 999)
        _deliver(recs, targets, manifest, False)
        for w, t in zip(weights, targets, strict=True):
            assert torch.equal(drec._bits(w.view(-1)), drec._bits(t))


def test_corrupt_or_misplaced_patch_is_named_either_way(path):
    weights, manifest, targets, recs = _one_percent_patches()
    sparse = next(r for r in recs if r.head[1] == drec.SPARSE)
    name, k = SHAPES[sparse.head[0]][0], sparse.head[4]
    body = torch.cat(sparse.body)  # positions, then values, each padded
    sparse.body = [body]
    values, positions = body.numel() - drec._pad(2 * k), body[:4 * k].view(torch.int32)
    body[values] ^= 1  # a value's bit, after the trainer took its digest
    with pytest.raises(dr._Drift, match=f"tensor '{name}': elements .* do not match the trainer's"):
        _deliver([sparse], [t.clone() for t in targets], manifest, False)
    body[values] ^= 1
    positions[0] += 1  # a position moved
    with pytest.raises(dr._Drift, match=f"tensor '{name}'.*do not match the trainer's"):
        _deliver([sparse], [t.clone() for t in targets], manifest, False)
    positions[0] = 1 << 30  # a position outside the tensor: nothing written there
    with pytest.raises(dr._Drift, match=f"tensor '{name}'.*do not match the trainer's"):
        _deliver([sparse], [t.clone() for t in targets], manifest, False)


def test_drifted_receiver_is_named_either_way(path):
    """A receiver whose copy is not the trainer's previous version where a patch lands."""
    weights, manifest = _setup()
    snaps = ds.Snapshots()
    targets = [torch.zeros_like(w).view(-1) for w in weights]
    _deliver(ds.records(_pieces(weights), manifest, snaps, True, 1 << 20), targets, manifest, True)
    targets[2][100] = 7  # tensor 'c' drifted here ...
    drec._bits(weights[2].view(-1))[100] += 1  # ... and the trainer changes that element
    with pytest.raises(dr._Drift, match="tensor 'c': elements .* do not match the trainer's"):
        _deliver(ds.records(_pieces(weights), manifest, snaps, False, 1 << 20), targets, manifest, False)


def test_no_compiler_means_the_torch_path(tmp_path):
    """Where the kernels cannot be built, delta mode says so once and takes the torch path."""
    import subprocess
    import sys
    code = ("import logging, torch; logging.basicConfig()\n"
            "from weightbus.engines.delta import cpu as k\n"
            "assert k.library() is None and k.usable(torch.zeros(4)) is None\n")
    env = {**__import__("os").environ, "CC": "false", "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "did not build" in out.stderr and "torch path" in out.stderr


def test_arena_keeps_one_chunk_as_record_sizes_vary():
    """The records' arena, over many updates whose records vary in size: every room of an
    update is its own (no two overlap), and the chunks do not pile up (they become one
    where they hold half as much again as an update asked for)."""
    arena = kernels.Arena(chunk=1000, device=torch.device("cpu"))  # (the GPU path's, on the host)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        arena.reset()
        spans = []
        for n in torch.randint(900, 1200, (5,), generator=g).tolist():
            out = arena.room(n)
            assert out.numel() == n
            spans.append((out.data_ptr(), out.data_ptr() + n))
            arena.take(n)
        spans.sort()
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert arena.nbytes <= 3 * (5 * 1200 + 1200) // 2 + 5 * 1200  # (and the last update's new chunks)


@pytest.mark.parametrize("n", [60, 1020, 5001, 8199])  # (the last bits in a whole word, or bytes after)
@pytest.mark.parametrize("kernel", ["c", "triton"])
def test_kernel_bitmap_patch_counts_its_bits_and_refuses_one_past_its_end(n, kernel, monkeypatch):
    """The patch of a bitmap record (C: a 64-bit word at a time, the last bytes one by one;
    Triton: 32-bit words assembled from bytes, a block of 4,096 bits per program): writes the
    values at its set bits and says how many there are; a bit past its n is refused (-1) and
    never written."""
    if kernel == "c":
        lib = kernels.library()
        if lib is None:
            pytest.skip("no C compiler")

        def patch(rows):
            return kernels.apply_many(lib, rows)
    else:
        _as_on_a_gpu(monkeypatch)

        def patch(rows):
            return gpu.apply_many(rows, torch.device("cpu"))
    on = [0, 7, n // 2, n - 1]
    vals = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int16)
    for past in (False, True):
        bits = torch.zeros(drec._pad((n + 7) // 8), dtype=torch.uint8)
        for i in on + ([n] if past else []):
            bits[i // 8] |= 1 << (i % 8)
        dst = torch.zeros(n + 1, dtype=torch.int16)  # (one more: a write past n would show)
        k = 5 if past else 4
        rows = torch.tensor([[drec.BITMAP, dst.data_ptr(), n, 2, 0, bits.data_ptr(), vals.data_ptr(), k]])
        status = int(patch(rows)[0, 1])
        assert int(dst[n]) == 0
        if past:
            assert status == -1
        else:
            assert status == 4 and dst[on].tolist() == [11, 12, 13, 14] and int(dst.count_nonzero()) == 4


def test_kernel_threads_setting(monkeypatch):
    monkeypatch.setenv("WEIGHTBUS_DELTA_THREADS", "3")
    assert kernels.threads() == 3
    monkeypatch.setenv("WEIGHTBUS_DELTA_THREADS", "zero")
    with pytest.raises(Exception, match="WEIGHTBUS_DELTA_THREADS"):
        kernels.threads()
    monkeypatch.setenv("WEIGHTBUS_DELTA_THREADS", "0")
    with pytest.raises(Exception, match="WEIGHTBUS_DELTA_THREADS"):
        kernels.threads()


def test_malformed_buckets_are_refused_either_way(path):
    """A bucket whose directory lies (a kind or tensor that does not exist, a range outside
    the tensor, a record past the bucket's end, a bitmap whose bits disagree with its
    count) is refused before a byte of it is written."""
    weights, manifest = _setup()
    snaps = ds.Snapshots()
    targets = [torch.zeros_like(w).view(-1) for w in weights]
    _deliver(ds.records(_pieces(weights), manifest, snaps, True, 1 << 20), targets, manifest, True)
    _mutate(weights, 0.2, 4)  # (20 %: bitmaps)
    recs = ds.records(_pieces(weights), manifest, snaps, False, 1 << 20)
    slot = torch.zeros(8 + sum(r.size for r in recs), dtype=torch.uint8)
    ds._fill(slot, recs)
    heads = slot[8:8 + len(recs) * drec._HEADER].view(torch.int64).view(len(recs), drec._WORDS)
    bitmap = next(i for i, r in enumerate(recs) if r.head[1] == drec.BITMAP)

    def refused(row, col, value, match):
        bad = slot.clone()
        h = bad[8:8 + len(recs) * drec._HEADER].view(torch.int64).view(len(recs), drec._WORDS)
        h[row, col] = value
        before = [t.clone() for t in targets]
        with pytest.raises(dr._Drift, match=match):
            dr._apply(bad, bad.numel(), targets, manifest, False)
        return before

    refused(0, 1, 9, "malformed .*kind 9")
    refused(0, 0, 99, "malformed .*tensor 99")
    for col, value in ((2, 1 << 40), (3, -1), (2, (1 << 62))):  # start, n
        before = refused(0, col, value, "lies outside")
        assert all(torch.equal(a, b) for a, b in zip(before, targets, strict=True))  # nothing written
    assert recs[0].head[1] != drec.DENSE
    refused(0, 1, drec.DENSE, "runs past its bucket")  # its values whole: longer than what it carries
    refused(bitmap, 4, int(heads[bitmap, 4]) - 1, "says .* changes but its bitmap has")
    patches = [i for i, r in enumerate(recs) if r.head[1] != drec.DENSE]
    for row in (patches[0], patches[-1]):  # a patch that says it carries nothing (first, last)
        refused(row, 4, 0, "tensor '")
    bad = slot.clone()  # the last record: positions, none of them (nothing for a GPU to launch)
    bad[8:8 + len(recs) * drec._HEADER].view(torch.int64).view(len(recs), drec._WORDS)[-1, [1, 4]] = \
        torch.tensor([drec.SPARSE, 0])
    with pytest.raises(dr._Drift):
        dr._apply(bad, bad.numel(), targets, manifest, False)


@pytest.mark.parametrize("capacity", [1 << 20, 3000, 700])
def test_buckets_of_blocks_land_bitwise(capacity, path):
    """What an update sends: the kernels' blocks (or the torch path's records) packed into
    buckets, a block split between buckets where it does not fit, each bucket filled and
    applied: every tensor lands bitwise."""
    # (sizes from 64 to ~2,200 elements: under Triton's interpreter each block's program
    # costs ~30 ms on CI's cores, so the range is spanned by 24 tensors, not 60; and by 12,
    # one in two, where 700-byte buckets split nearly every record: ~100 buckets otherwise)
    step = 2 if path == "triton" and capacity < 1000 else 1
    shapes = [(f"t{i}", (64 + 93 * i,)) for i in range(0, 24, step)] + [("big", (5000 // step,))]
    weights, manifest, snaps, targets = _bf16_model(shapes, 9)
    for step, fraction in enumerate([None, 0.02, 0.3]):
        if fraction is not None:
            _mutate(weights, fraction, 20 + step)
        items = ds._records(_pieces(weights), manifest, snaps, fraction is None, capacity - 16)
        buckets = list(ds._buckets(items, capacity - 8))
        if fraction is not None and path == "kernels":
            assert any(isinstance(it, ds.Block) for b in buckets for it in b)
        for b in buckets:
            size = 8 + sum(it.size for it in b)
            assert size <= capacity - 8
            slot = torch.zeros(size, dtype=torch.uint8)
            ds._fill(slot, b)
            dr._apply(slot, size, targets, manifest, fraction is None)
        for w, t in zip(weights, targets, strict=True):
            assert torch.equal(drec._bits(w.view(-1)), drec._bits(t))


def test_gpu_block_layout_sums_each_piece_in_element_order():
    """The GPU diff's blocks (every piece's whole blocks first, then the partial last ones):
    each piece's sums and each block's changes before it in its piece are those of its
    blocks in element order; a layout is kept per set of piece sizes, within its bytes."""
    B = gpu.BLOCK
    sizes = torch.tensor([3 * B, 5, 2 * B + 7, B, 1], dtype=torch.int64)
    lay = gpu._WholeFirst(sizes, torch.device("cpu"))
    assert lay.whole == 6 and len(lay.item) == 9
    # the blocks' pieces and first elements: piece by piece in element order
    got = sorted(zip(lay.item.tolist(), lay.off.tolist(), range(len(lay.item)), strict=True))
    want = [(p, o) for p, n in enumerate(sizes.tolist()) for o in range(0, n, B)]
    assert [(p, o) for p, o, _ in got] == want
    x = torch.randint(0, 1000, (2, len(lay.item)), dtype=torch.int64)
    running = torch.stack([torch.cumsum(x[0], 0), torch.cumsum(x[1], 0)])
    before = lay.before(running[0])
    sums = lay.per_piece(running, x)
    for p in range(len(sizes)):
        mine = [b for q, _, b in got if q == p]  # (its blocks, in element order)
        assert sums[:, p].tolist() == [int(x[0, mine].sum()), int(x[1, mine].sum())]
        assert [int(before[b]) for b in mine] == [int(x[0, mine[:i]].sum()) for i in range(len(mine))]
    layouts = gpu.Layouts(most=2 * lay.nbytes)
    a = layouts.get(sizes, torch.device("cpu"))
    assert layouts.get(sizes.clone(), torch.device("cpu")) is a  # (kept)
    layouts.get(sizes + 1, torch.device("cpu"))
    layouts.get(sizes + 2, torch.device("cpu"))  # (past its bytes: the others dropped)
    assert layouts.nbytes <= 2 * lay.nbytes and layouts.get(sizes, torch.device("cpu")) is not a


def test_whole_digests_agree_either_way(path):
    """The running check of a whole destination (a kernel row that reads, never writes):
    every path sums ``w(i) * x[i]`` over the bit patterns the same way, a changed element
    anywhere changes its tensor's digest, and nothing is written. (The last shape: whole
    spans of the GPU kernel's programs, read unmasked, and a partial one.)"""
    g = torch.Generator().manual_seed(3)
    shapes = [(300, 7), (5,), (4099,), (1,), (0,), (3, (1 << 16) + 7)]
    tensors = [(torch.randn(s, generator=g) * 20).to(dt).view(-1) for s in shapes for dt in DTYPES]
    want = torch.stack([drec._weighted_range(0, drec._bits(t).long()) for t in tensors])
    before = [t.clone() for t in tensors]
    got = dr.digests(tensors)
    assert torch.equal(got, want)
    assert all(torch.equal(drec._bits(a), drec._bits(b)) for a, b in zip(tensors, before, strict=True))
    drec._bits(tensors[9])[4000] ^= 1  # one bit of one element
    drec._bits(tensors[21])[70000] ^= 1 << 9  # (bfloat16, in the second whole span)
    changed = (dr.digests(tensors) != got).nonzero().squeeze(1).tolist()
    assert changed == [9, 21]


def test_a_whole_destination_check_that_fails_to_read_fails_the_update(monkeypatch):
    """The check's read on a host runs on a thread: what it raises is the update's error
    (naming the rank and the phase), never a check silently skipped; the chain's sums are
    dropped (the next update goes whole)."""
    from types import SimpleNamespace

    targets = [torch.arange(10, dtype=torch.int16), torch.arange(7, dtype=torch.int16)]
    engine = SimpleNamespace(verify_every=1, where=lambda: "gloo rollout rank 1")
    chain = dr.Chain()
    chain.sums = dr.digests(targets)
    manifest = Manifest([TensorMeta("a", torch.int16, (10,)), TensorMeta("b", torch.int16, (7,))])
    check = dr.WholeCheck(engine, chain, targets, full=False)  # (a clean read: no error)
    check.before_writes()
    assert check.finish(targets, manifest, 2, torch.zeros(2, dtype=torch.int64), None) is None

    def broken(_):
        raise RuntimeError("the copy is gone")
    monkeypatch.setattr(dr, "digests", broken)
    check = dr.WholeCheck(engine, chain, targets, full=False)
    check.before_writes()
    error = check.finish(targets, manifest, 3, torch.zeros(2, dtype=torch.int64), None)
    assert "gloo rollout rank 1" in error and "whole-destination check: the copy is gone" in error
    assert chain.sums is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CI has none: the Triton kernels "
                    "run under Triton's interpreter in test_whole_digests_agree_either_way)")
def test_whole_digests_on_cuda():
    g = torch.Generator().manual_seed(4)
    tensors = [(torch.randn(s, generator=g) * 20).to(dt).view(-1).cuda()
               for s in [(300, 7), (5,), (4099,), (1 << 20,), (0,)] for dt in DTYPES]
    want = torch.stack([drec._weighted_range(0, drec._bits(t.cpu()).long()) for t in tensors])
    assert torch.equal(dr.digests(tensors), want)


@pytest.mark.parametrize("budget", [None, [2000]], ids=["one-round", "rounds"])
def test_a_table_replays_the_diff_of_the_same_pieces_and_only_of_them(budget, path):
    """The kernel calls of a fixed list of pieces are worked out by one update and replayed
    by the next ones (``ds.table_for``; the loop over pieces does not run: the pieces are
    not even read), the pieces a cast (float32 source, bfloat16 wire) or a strided cut
    copied again each time; a piece replaced by another tensor, or a tensor given new
    memory under the same object, makes a new table. The weights change at every update;
    every update lands bitwise. (The torch path makes no table: it has no kernel calls.)"""
    from weightbus.packing import native
    g = torch.Generator().manual_seed(5)
    a = torch.randn(300, 7, generator=g).to(torch.bfloat16)
    wide = torch.randn(64, 40, generator=g)  # (float32: cast onto the wire)
    d = torch.randn(50, 8, generator=g).to(torch.bfloat16)
    views = [a, torch.randn(5, generator=g).to(torch.bfloat16), wide, d[:, 2:5]]  # (the last strided)
    manifest = Manifest(TensorMeta(f"t{i}", torch.bfloat16, tuple(v.shape)) for i, v in enumerate(views))
    read = [0]

    def pieces():
        for i, v in enumerate(views):
            read[0] += 1
            yield i, 0, v

    def deliver(made, full):
        items = ds._read_digests(made)
        recs = [x for it in items for x in (it.records() if isinstance(it, ds.Block) else [it])]
        _deliver(recs, targets, manifest, full)

    def update(full, table=None):
        read[0] = 0
        made = []
        for r in ds._records(pieces(), manifest, snaps, full, 1 << 20, budget, table):
            if r is None:  # (a round's records go before the next round reuses their arenas)
                deliver(made, full)
                made = []
            else:
                made.append(r)
        deliver(made, full)
        for i, (v, t) in enumerate(zip(views, targets, strict=True)):
            assert torch.equal(_bits(t), _bits(v.to(torch.bfloat16).reshape(-1))), (i, full)

    snaps = ds.Snapshots()
    targets = [torch.zeros(v.numel(), dtype=torch.bfloat16) for v in views]
    update(True)
    tables = []
    for step in range(1, 7):
        for v in views:  # (2% of every piece, in place: the strided cut's through its parent)
            rows = torch.randint(0, v.shape[0], (max(1, v.numel() // 50),), generator=g)
            v[rows] += 1
        if step == 3:
            views[1] = views[1].clone()  # another tensor in the list
        if step == 4:
            a.data = a.data.clone()  # the same object, new memory
        tables.append(ds.table_for(snaps, "t", list(views), native.data_ptrs(views)))
        update(False, tables[-1])
        if path != "torch":
            assert bool(tables[-1].steps), step  # (every piece went to the kernels: tabled)
            assert read[0] == (len(views) if step in (1, 3, 4) else 0), (step, read[0])
    if path == "torch":
        assert not any(t.steps for t in tables)
    else:  # (made at 1, replayed at 2; made again at 3 and 4, replayed at 5 and 6)
        assert [tables[k] is tables[k - 1] for k in range(1, 6)] == [True, False, False, True, True]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return drec._bits(t.contiguous())


def test_a_round_started_early_leaves_the_last_rounds_records(monkeypatch):
    """The sender starts round r + 1 (its first group's diff launched, nothing waited for:
    ``sender._Rounds.ahead``) before it packs round r's records. Under Triton's interpreter
    (the GPU's path on host tensors, where nothing orders the arena's reuse as a stream
    would), round r's records must still be whole when packed after that: a round started
    as far as its records pass would write over them in the arena, and a patch would not
    land bitwise (or fail its digest)."""
    _as_on_a_gpu(monkeypatch)
    monkeypatch.setattr(ds, "_GROUP", 6000)  # (a group per piece or two: several per round)
    shapes = [(f"t{i}", (4096 + 1500 * i,)) for i in range(6)]
    weights, manifest, snaps, targets = _bf16_model(shapes, 11)
    for step, fraction in enumerate([None, 0.02, 0.02]):
        if fraction is not None:
            _mutate(weights, fraction, 40 + step)
        items = ds._records(_pieces(weights), manifest, snaps, fraction is None, 1 << 20, [20000, 40000],
                            marks=True)
        rounds, made = ds._Rounds(items, 1 << 20), 1
        buckets, more, error = rounds.take("test")
        while error is None:
            if more:
                assert rounds.ahead("test") is None  # (the next round started before this one is packed)
            for b in buckets:
                size = 8 + sum(it.size for it in b)
                slot = torch.zeros(size, dtype=torch.uint8)
                ds._fill(slot, b)
                dr._apply(slot, size, targets, manifest, fraction is None)
            if not more:
                break
            buckets, more, error = rounds.take("test")
            made += 1
        assert error is None and made >= 3, (error, made)
        for w, t in zip(weights, targets, strict=True):
            assert torch.equal(drec._bits(w.view(-1)), drec._bits(t))


def test_a_gpus_checks_read_later_still_name_the_patch(monkeypatch):
    """A GPU receiver reads a bucket's checks back once it has joined the next round
    (``_apply(..., later=)``): the writes are launched and the checks kept; a corrupt value
    still fails, naming the tensor, when they are read; a whole patch's pass."""
    _as_on_a_gpu(monkeypatch)
    weights, manifest, targets, recs = _one_percent_patches()
    slot = torch.zeros(8 + sum(r.size for r in recs), dtype=torch.uint8)
    ds._fill(slot, recs)
    sparse = next(i for i, r in enumerate(recs) if r.head[1] == drec.SPARSE)
    name = SHAPES[recs[sparse].head[0]][0]
    bad = slot.clone()
    k = recs[sparse].head[4]
    at = 8 + len(recs) * drec._HEADER + sum(r.size - drec._HEADER for r in recs[:sparse]) + drec._pad(4 * k)
    bad[at] ^= 1  # (its first value's low byte, after the trainer took its digest)
    later: list = []
    dr._apply(bad, bad.numel(), [t.clone() for t in targets], manifest, False, later=later)
    assert len(later) == 1  # (nothing raised yet: the writes are in flight)
    with pytest.raises(dr._Drift, match=f"tensor '{name}'.*do not match the trainer's"):
        later[0]()
    later.clear()
    dr._apply(slot, slot.numel(), targets, manifest, False, later=later)
    for check in later:
        check()
    for w, t in zip(weights, targets, strict=True):
        assert torch.equal(drec._bits(w.view(-1)), drec._bits(t))
