"""fp8 on the wire: a bf16 (or fp32) trainer updates an fp8 rollout with half the bytes,
bitwise as the quantizer makes them (tests/test_vllm_quant.py holds the quantizer to
vLLM's own, bit for bit)."""

import pytest
import torch
import workers_quant

from weightbus import ModuleSource
from weightbus.errors import PlanError
from weightbus.quant import FP8, Fp8Format, QuantizedSource, module_formats
from weightbus.runtime.local import spawn


@pytest.mark.parametrize("backend,T,R,dtype", [("gloo", 1, 2, "bfloat16"), ("gloo", 2, 1, "float32"),
                                               ("colocated", 1, 1, "bfloat16")])
def test_fp8_updates_bitwise_half_the_bytes(port, backend, T, R, dtype):
    logs = spawn(workers_quant.fp8_updates, T + R, (backend, T, R, port, dtype), timeout=240)
    previous = None
    for k in range(3):
        expected = logs[0][k]["expected"]
        assert all(t[k]["expected"] == expected for t in logs[:T])
        for r in logs[T:]:
            assert r[k]["got"] == expected, f"update {k + 1}"
            assert r[k]["version"] == k + 1
        assert expected != previous  # the weights (and the fp8 payloads) really changed
        previous = expected
        # the served weights travel in half their bf16 bytes, plus their scales
        assert logs[0][k]["bf16_bytes"] / 2 < logs[0][k]["fp8_bytes"] < 0.51 * logs[0][k]["bf16_bytes"]


@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
@pytest.mark.parametrize("shape", [(256, 384), (300, 136), (1, 5), (129, 1)])
def test_quantize_is_close_and_deterministic(kind, shape):
    torch.manual_seed(1)
    x = torch.randn(shape).bfloat16() * 3
    x[0] = 0  # a zero row: a zero payload, a finite scale
    fmt = Fp8Format(kind)
    q, scale = fmt.quantize(x)
    assert q.dtype == FP8 and tuple(q.shape) == shape and tuple(scale.shape) == fmt.scale_shape(shape)
    assert torch.isfinite(scale).all() and (q[0].float() == 0).all()
    back = fmt.dequantize(q, scale)
    # e4m3 keeps 3 mantissa bits: within 1/16 of each value plus half a step near zero
    tol = x.float().abs() / 16 + fmt.dequantize(torch.ones_like(q), scale) / 2 ** 7
    assert ((back - x.float()).abs() <= tol).all()
    q2, scale2 = fmt.quantize(x.clone())
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)


def test_slabs_give_the_bits_of_one_pass(monkeypatch):
    import weightbus.quant as quant
    x = torch.randn(1000, 520).bfloat16()
    whole = [Fp8Format(k).quantize(x) for k in ("block", "channel", "tensor")]
    monkeypatch.setattr(quant, "_SLAB", 1)  # a slab of one block row (one row) at a time
    for (q, s), k in zip(whole, ("block", "channel", "tensor"), strict=True):
        q2, s2 = Fp8Format(k).quantize(x)
        assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2), k


def test_formats_read_off_the_rollout_model():
    state = workers_quant.rollout_state(workers_quant.SERVED)
    assert module_formats(state) == workers_quant.SERVED
    state["odd.weight"] = torch.zeros(300, 200, dtype=FP8)
    state["odd.weight_scale_inv"] = torch.zeros(5, 4)  # blocks of 64 rows x 64 columns
    assert module_formats(state)["odd.weight"] == Fp8Format("block", (64, 64))
    state["bad.weight"] = torch.zeros(10, 10, dtype=FP8)
    state["bad.weight_scale_inv"] = torch.zeros(11, 1)
    with pytest.raises(PlanError, match="'bad.weight'.*no block size"):
        module_formats(state)


def test_bad_declarations_fail_where_given():
    model = workers_quant.Trainer(torch.bfloat16)
    source = ModuleSource(model, dtype=torch.bfloat16)
    with pytest.raises(PlanError, match="not in the source.*'nope.weight'"):
        QuantizedSource(source, {"nope.weight": Fp8Format()})
    with pytest.raises(PlanError, match="'up.bias'.*2-D"):
        QuantizedSource(source, {"up.bias": Fp8Format("channel")})
    with pytest.raises(PlanError, match="not an Fp8Format"):
        QuantizedSource(source, {"q.weight": "fp8"})
    with pytest.raises(ValueError, match="kind"):
        Fp8Format("mxfp8")  # type: ignore[arg-type]


def test_nan_or_inf_weights_are_refused_by_name():
    model = workers_quant.Trainer(torch.bfloat16)
    with torch.no_grad():
        model.q.weight[200, 7] = float("nan")
    source = QuantizedSource(ModuleSource(model, dtype=torch.bfloat16), workers_quant.SERVED)
    with pytest.raises(PlanError, match=r"'q.weight' holds NaN or inf \(the block scale at \[1, 0\]"):
        list(source)
    with torch.no_grad():
        model.q.weight[200, 7] = 0
        model.up.weight[3, 3] = float("inf")
    with pytest.raises(PlanError, match=r"'up.weight' holds NaN or inf \(the channel scale at \[3, 0\]"):
        list(source)


def test_manifest_puts_each_scale_after_its_weight():
    source = QuantizedSource(ModuleSource(workers_quant.Trainer(torch.bfloat16), dtype=torch.bfloat16),
                             workers_quant.SERVED)
    names = [(m.name, m.dtype, m.shape) for m in source.manifest]
    assert names == [("embed.weight", torch.bfloat16, (300, 136)),
                     ("q.weight", FP8, (264, 136)), ("q.weight_scale_inv", torch.float32, (3, 2)),
                     ("up.weight", FP8, (40, 136)), ("up.weight_scale", torch.float32, (40, 1)),
                     ("up.bias", torch.bfloat16, (40,)),
                     ("down.weight", FP8, (136, 40)), ("down.weight_scale", torch.float32, ())]
    assert [n for n, _ in source] == [n for n, _, _ in names]


def _kernel_ready() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


gpu = pytest.mark.skipif(not _kernel_ready(), reason="the fp8 kernel needs a CUDA GPU and Triton")


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_kernel_gives_the_plain_path_bits(dtype):
    from weightbus.quant import quantize_many
    torch.manual_seed(3)
    shapes = [(256, 384), (300, 136), (1, 5), (129, 1), (768, 2048), (2048, 768), (151, 4097)]
    xs = [(torch.randn(s, device="cuda") * torch.logspace(-4, 3, s[1], device="cuda")).to(dtype)
          for s in shapes]
    xs[0][:128, :128] = 0  # an all-zero block
    xs[1][7] = 1e-30  # subnormal in fp8 after scaling, next to normal values
    # full blocks of a tensor that starts off 16-byte alignment (no wide accesses)
    xs.append(torch.randn(1 + 256 * 384, device="cuda").to(dtype)[1:].view(256, 384))
    xs.append(torch.randn(300, 136, device="cuda").to(dtype))
    xs[-1][130, 3] = float("nan")  # a NaN in a full block and in a ragged one: NaN scales
    xs[-1][299, 135] = float("nan")
    fmt = Fp8Format("block")
    cache: dict = {}
    # 1: set up, a chunk at a time; 2, 3: the same tensors changed in place (the call
    # replayed: set up as one launch, then run again); 4: one tensor given new memory (set
    # up again); 5: replayed
    for step in (1, 2, 3, 4, 5):
        if step in (2, 3, 5):
            for x in xs:
                x.mul_(1.5)
        if step == 4:
            xs[4] = xs[4].clone() * -1
        got = quantize_many([(fmt, x) for x in xs], cache=cache)
        for x, (q, s) in zip(xs, got, strict=True):
            rq, rs = fmt.quantize(x)  # the plain path (held to vLLM's bits in test_vllm_quant.py)
            if not x.isnan().any():  # (a NaN block's payload is not defined: its update is refused)
                assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), (step, x.shape)
            assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s.nan_to_num(), rs.nan_to_num()), \
                (step, x.shape)


@gpu
def test_fp8_updates_from_a_gpu_in_bulk_bitwise(port):
    """A CUDA trainer's source built once: its weights quantized in bulk at every update
    (one replayed launch from the second), the same list handed again on the third."""
    logs = spawn(workers_quant.fp8_updates, 2, ("gloo", 1, 1, port, "bfloat16", True), timeout=240)
    previous = None
    for k in range(3):
        expected = logs[0][k]["expected"]
        assert logs[1][k]["got"] == expected, f"update {k + 1}"
        assert expected != previous
        previous = expected
    bulk = [u["bulk"] for u in logs[0]]
    assert None not in bulk and bulk[1] == bulk[2], bulk


@gpu
def test_fp8_into_a_colocated_rollout_written_by_the_quantizer(port):
    trainer, rollout = spawn(workers_quant.fp8_direct, 2, (port,), timeout=300)
    for k in (0, 1, 2, 4):
        assert trainer[k]["fused"], k
        assert rollout[k]["got"] == trainer[k]["expected"], f"update {k + 1}"
        assert rollout[k]["version"] == k + 1
    assert trainer[0]["expected"] != trainer[1]["expected"] != trainer[2]["expected"]
    for side in (trainer, rollout):  # a NaN: both ranks fail, naming the weight
        assert "'q.weight' holds NaN or inf" in side[3]["error"], side[3]


@gpu
def test_gpu_source_groups_bitwise_and_names_a_nan():
    model = workers_quant.Trainer(torch.bfloat16).cuda()
    for group in (1 << 30, 0):
        source = QuantizedSource(ModuleSource(model, dtype=torch.bfloat16), workers_quant.SERVED,
                                 group_bytes=group)
        for step in (1, 2):  # the second update reuses the first's launch, with new weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * step)
            got = dict(source)
            for name, fmt in workers_quant.SERVED.items():
                q, s = fmt.quantize(model.state_dict()[name])
                assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8))
                assert torch.equal(got[fmt.scale_name(name)], s)
    # the kernels' set-ups are kept for one update's tensors: a source that yields new
    # ones (an fp32 trainer's weights cast to bf16 at every update) does not pile them up
    fp32 = workers_quant.Trainer(torch.float32).cuda()
    source32 = QuantizedSource(ModuleSource(fp32, dtype=torch.bfloat16), workers_quant.SERVED, group_bytes=0)
    for _ in range(4):
        got = dict(source32)
        assert len(source32.launches) <= 2 * len(workers_quant.SERVED)  # (a set-up and a replay a group)
    for name, fmt in workers_quant.SERVED.items():
        q, s = fmt.quantize(fp32.state_dict()[name].to(torch.bfloat16))
        assert torch.equal(got[name].view(torch.uint8), q.view(torch.uint8))
    for bad in (float("inf"), float("nan")):  # (a NaN too: the kernel's max must not drop it)
        with torch.no_grad():
            model.q.weight[200, 7] = bad
        for group in (1 << 30, 0):
            source = QuantizedSource(ModuleSource(model, dtype=torch.bfloat16), workers_quant.SERVED_BLOCK,
                                     group_bytes=group)
            assert source.plain_tensors() is None  # (the bulk path gives way, and the stream names it)
            with pytest.raises(PlanError, match=r"'q.weight' holds NaN or inf \(the block scale at \[1, 0\]"):
                list(source)


def _zeros(source: QuantizedSource, device: str) -> list[torch.Tensor]:
    return [torch.zeros(m.shape, dtype=torch.uint8 if m.dtype == FP8 else m.dtype, device=device)
            .view(m.dtype) for m in source.manifest]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=gpu)])
def test_written_straight_into_the_rollouts_tensors(device):
    """``direct_writer``: every tensor of the update lands in the rollout's own (the fp8 payloads,
    their scales, the tensors served as they are), bitwise as the source yields them, over
    updates of changing weights, set up once while nothing moved; on a GPU the block
    weights go through the kernel with no fp8 copy of the model between."""
    model = workers_quant.Trainer(torch.bfloat16).to(device)
    source = QuantizedSource(ModuleSource(model, dtype=torch.bfloat16), workers_quant.SERVED)
    dests = _zeros(source, device)
    write = source.direct_writer(dests)
    set_ups = []
    for k in (1, 2, 3):
        model.step(k)
        assert write()
        set_ups.append(write.held_at)
        for m, d, (name, t) in zip(source.manifest, dests, source, strict=True):
            assert name == m.name and torch.equal(_bits(d), _bits(t)), (k, name)
    assert set_ups[0] is set_ups[1] is set_ups[2]  # set up once
    if device == "cuda":
        assert source._last is None  # plain_tensors' fp8 copy of the model was never made
        assert write.launches and all(launch.payload is None for launch, _ in write.launches)
    # a weight given new memory (the module's parameter replaced): followed, set up again
    with torch.no_grad():
        model.q.weight.data = model.q.weight.data.clone() * 2
    assert write() and write.held_at is not set_ups[0]
    assert torch.equal(_bits(dests[1]), _bits(dict(source)["q.weight"]))


def test_writer_refuses_what_does_not_fit():
    model = workers_quant.Trainer(torch.bfloat16)
    source = QuantizedSource(ModuleSource(model, dtype=torch.bfloat16), workers_quant.SERVED)
    dests = _zeros(source, "cpu")
    with pytest.raises(PlanError, match="7 destinations for 8 tensors"):
        source.direct_writer(dests[:-1])
    with pytest.raises(PlanError, match=r"the destination of 'q.weight_scale_inv' float32\[3, 2\] is "
                                        r"float32\[2, 3\]"):
        source.direct_writer([*dests[:2], torch.zeros(2, 3), *dests[3:]])
    # where it cannot, it says so and writes nothing: a payload's destination not
    # contiguous; an fp32 trainer (its weights are cast to bf16 first, by the usual path)
    strided = torch.zeros(136, 264, dtype=torch.uint8).view(FP8).t()
    model.step(1)
    assert not source.direct_writer([dests[0], strided, *dests[2:]])()
    fp32 = QuantizedSource(ModuleSource(workers_quant.Trainer(torch.float32), dtype=torch.bfloat16),
                           workers_quant.SERVED)
    assert not fp32.direct_writer(dests)()
    assert all(not _bits(d).any() for d in dests)
    # a NaN: the update fails, naming the weight
    with torch.no_grad():
        model.q.weight[200, 7] = float("nan")
    with pytest.raises(PlanError, match=r"'q.weight' holds NaN or inf \(the block scale at \[1, 0\]"):
        source.direct_writer(dests)()


def test_fp8_deltas_bitwise_fewer_bytes(port):
    from benchmarks.quant_delta import fp8_deltas
    shapes = [("model.embed_tokens.weight", (300, 136)), ("q.weight", (264, 136)),
              ("down.weight", (640, 384)), ("norm.weight", (136,))]
    sent, got = spawn(fp8_deltas, 2, (port, shapes, 3, 0.02), timeout=240)
    assert [g["version"] for g in got] == [1, 2, 3, 4]
    for k, (s, g) in enumerate(zip(sent, got, strict=True)):
        assert s["expected"] == g["got"], f"update {k + 1}"  # every tensor, bitwise
        if k:
            assert s["delta"] is True and s["wire"] < 0.5 * s["dense"]
            # one bf16 step moves few fp8 values, but most blocks hold one that moved
            assert 0 < s["fp8_elements"] < 0.02 and s["fp8_blocks"] > 0.5
    assert len({s["expected"]["q.weight"] for s in sent}) == 4  # the payloads really changed
