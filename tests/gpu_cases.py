"""Running one inference-engine GPU case (``tests/vllm_gpu_cases.py``,
``tests/sglang_gpu_cases.py``) as the GPU tests do: in its own process group, ended by its
id after it (an engine left behind would hold its GPU memory), its ``RESULT {json}`` rows
collected (and appended to the file ``results_env`` names, if set)."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_case(script: str, case: str, timeout: float, results_env: str) -> tuple[list[dict], str]:
    """The case's rows and its output (its last 6,000 characters are the failure's story)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE),
                                                       os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(HERE / script), case], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = f"(case {case} timed out)"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the engine's processes with it
        except ProcessLookupError:
            pass
        proc.wait()
    rows = [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]
    if os.environ.get(results_env):
        with open(os.environ[results_env], "a") as f:
            for row in rows or [{"case": case, "ok": False, "tail": out[-3000:]}]:
                f.write(json.dumps(row) + "\n")
    return rows, out
