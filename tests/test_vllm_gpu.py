"""vLLM as the RL frameworks run it, on real GPUs (skipped without CUDA or without vLLM):
hybrid with sleep levels 1 and 2 over CUDA IPC (a Qwen3-MoE), disaggregated over NCCL with
CUDA graphs, TP=2 receiving only its shards, and a block-fp8 model fed from a bf16 trainer.
Each case (``tests/vllm_gpu_cases.py``) runs in its own process group, ended by its id
after it (an engine left behind would hold its GPU memory). ``WB_VLLM_RESULTS=FILE``
collects each case's result row (``benchmarks/vllm_gpu.sh`` sets it)."""

import os

import pytest
from gpu_cases import run_case

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

pytestmark = pytest.mark.gpu
NEEDS = {"hybrid": 1, "fp8": 1, "nccl": 2, "tp2": 3}


@pytest.mark.parametrize("case", list(NEEDS))
def test_vllm_on_gpus(case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() < NEEDS[case]:
        pytest.skip(f"needs {NEEDS[case]} GPUs")
    rows, out = run_case("vllm_gpu_cases.py", case, float(os.environ.get("WB_VLLM_CASE_TIMEOUT", 420)),
                         "WB_VLLM_RESULTS")
    assert rows and rows[-1]["ok"], out[-6000:]
