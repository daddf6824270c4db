"""SGLang as a rollout engine on real GPUs (skipped without CUDA or without SGLang): hybrid
with its memory released while the trainer steps, over CUDA IPC (a Qwen3-MoE);
disaggregated over NCCL with CUDA graphs, refusals and recovery; TP=2. Each case
(``tests/sglang_gpu_cases.py``) runs in its own process group, ended by its id after it (an
engine left behind would hold its GPU memory). ``WB_SGLANG_RESULTS=FILE`` collects each
case's result row (``benchmarks/sglang_gpu.sh`` sets it)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

pytestmark = pytest.mark.gpu
HERE = Path(__file__).resolve().parent
NEEDS = {"hybrid": 1, "nccl": 2, "tp2": 2}


@pytest.mark.parametrize("case", list(NEEDS))
def test_sglang_on_gpus(case):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.device_count() < NEEDS[case]:
        pytest.skip(f"needs {NEEDS[case]} GPUs")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE),
                                                       os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(HERE / "sglang_gpu_cases.py"), case], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=float(os.environ.get("WB_SGLANG_CASE_TIMEOUT", 420)))
    except subprocess.TimeoutExpired:
        out = f"(case {case} timed out)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine's processes with it
        except ProcessLookupError:
            pass
        proc.wait()
    rows = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    if os.environ.get("WB_SGLANG_RESULTS"):
        with open(os.environ["WB_SGLANG_RESULTS"], "a") as f:
            for row in rows or [{"case": case, "ok": False, "tail": out[-3000:]}]:
                f.write(json.dumps(row) + "\n")
    assert rows and rows[-1]["ok"], out[-6000:]
