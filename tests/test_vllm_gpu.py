"""vLLM as the RL frameworks run it, on real GPUs (skipped without CUDA or without vLLM):
hybrid with sleep levels 1 and 2 over CUDA IPC (a Qwen3-MoE), disaggregated over NCCL with
CUDA graphs, TP=2 receiving only its shards, and a block-fp8 model fed from a bf16 trainer.
Each case (``tests/vllm_gpu_cases.py``) runs in its own process group, ended by its id
after it (an engine left behind would hold its GPU memory). ``WB_VLLM_RESULTS=FILE``
collects each case's result row (``benchmarks/vllm_gpu.sh`` sets it)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
NEEDS = {"hybrid": 1, "fp8": 1, "nccl": 2, "tp2": 3}


@pytest.mark.parametrize("case", list(NEEDS))
def test_vllm_on_gpus(case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() < NEEDS[case]:
        pytest.skip(f"needs {NEEDS[case]} GPUs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(HERE / "vllm_gpu_cases.py"), case], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=float(os.environ.get("WB_VLLM_CASE_TIMEOUT", 420)))
    except subprocess.TimeoutExpired:
        out = f"(case {case} timed out)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine's processes with it
        except ProcessLookupError:
            pass
        proc.wait()
    rows = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    if os.environ.get("WB_VLLM_RESULTS"):
        with open(os.environ["WB_VLLM_RESULTS"], "a") as f:
            for row in rows or [{"case": case, "ok": False, "tail": out[-3000:]}]:
                f.write(json.dumps(row) + "\n")
    assert rows and rows[-1]["ok"], out[-6000:]
