"""SGLang as a rollout engine on real GPUs (skipped without CUDA or without SGLang): hybrid
with its memory released while the trainer steps, over CUDA IPC (a Qwen3-MoE);
disaggregated over NCCL with CUDA graphs, refusals and recovery; TP=2. Each case
(``tests/sglang_gpu_cases.py``) runs in its own process group, ended by its id after it (an
engine left behind would hold its GPU memory). ``WB_SGLANG_RESULTS=FILE`` collects each
case's result row (``benchmarks/sglang_gpu.sh`` sets it)."""

import os

import pytest
from gpu_cases import run_case

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

pytestmark = pytest.mark.gpu
NEEDS = {"hybrid": 1, "nccl": 2, "tp2": 2}


@pytest.mark.parametrize("case", list(NEEDS))
def test_sglang_on_gpus(case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() < NEEDS[case]:
        pytest.skip(f"needs {NEEDS[case]} GPUs")
    rows, out = run_case("sglang_gpu_cases.py", case, float(os.environ.get("WB_SGLANG_CASE_TIMEOUT", 420)),
                         "WB_SGLANG_RESULTS")
    assert rows and rows[-1]["ok"], out[-6000:]
