"""The fp8 quantizers against vLLM's own, bit for bit: what a bf16 (or fp32) trainer sends
an fp8 rollout is exactly what vLLM would have made of the same weights."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape  # noqa: E402
from vllm.utils.deep_gemm import per_block_cast_to_fp8  # noqa: E402

from weightbus.quant import Fp8Format  # noqa: E402

SHAPES = [(256, 384), (300, 136), (129, 1), (1, 5), (640, 2048)]


def _inputs(shape, dtype):
    torch.manual_seed(sum(shape))
    x = torch.randn(shape, dtype=torch.float32) * torch.logspace(-3, 2, shape[1])  # wide ranges
    x[0] = 0  # an all-zero row (and block)
    return x.to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _vllm_rows_or_tensor(x, per_row):
    from vllm.config import VllmConfig, set_current_vllm_config
    with set_current_vllm_config(VllmConfig()):
        op = QuantFP8(static=False, group_shape=GroupShape.PER_TOKEN if per_row else GroupShape.PER_TENSOR)
    return op.forward_native(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_block_fp8_equals_vllm(shape, dtype):
    x = _inputs(shape, dtype)
    ref_q, ref_s = per_block_cast_to_fp8(x, [128, 128])
    q, s = Fp8Format("block").quantize(x)
    assert _same(q, ref_q) and torch.equal(s, ref_s)


@pytest.mark.parametrize("kind", ["channel", "tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_row_and_tensor_fp8_equal_vllm(shape, dtype, kind):
    x = _inputs(shape, dtype)
    ref_q, ref_s = _vllm_rows_or_tensor(x, kind == "channel")
    q, s = Fp8Format(kind).quantize(x)
    assert _same(q, ref_q) and torch.equal(s.reshape(ref_s.shape), ref_s)


@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
def test_nan_and_inf_blocks_as_vllm(kind):
    x = _inputs((256, 256), torch.bfloat16)
    x[3, 3], x[200, 250] = float("nan"), float("inf")
    if kind == "block":
        ref_q, ref_s = per_block_cast_to_fp8(x, [128, 128])
    else:
        ref_q, ref_s = _vllm_rows_or_tensor(x, kind == "channel")
    q, s = Fp8Format(kind).quantize(x)
    nan = ref_q.float().isnan()  # (the same places; a NaN's sign bit may differ)
    assert torch.equal(q.float().isnan(), nan) and nan.any()
    assert _same(q[~nan], ref_q[~nan])
    assert torch.equal(s.reshape(ref_s.shape).nan_to_num(7.0), ref_s.nan_to_num(7.0))
