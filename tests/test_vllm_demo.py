"""``weightbus demo --rollout vllm``: FSDP2 trainers -> a real vLLM engine, every update
checked against transformers. Skipped where vLLM is not installed."""

import pytest

pytest.importorskip("vllm")


def test_vllm_demo():
    from weightbus.integrations.vllm.demo import run_vllm_demo

    rows = run_vllm_demo(trainers=2, steps=2, hidden=128, layers=2)
    assert [r["version"] for r in rows] == ["1", "2"]
    assert all(r["verified"] for r in rows), rows


def test_vllm_demo_cli_keeps_engine_logs_out_of_the_table():
    """The command a newcomer runs: the table and one line naming the engine's log file,
    not vLLM's ~95 lines of logs and warnings around it (``--verbose`` prints them)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    out = subprocess.run([sys.executable, "-m", "weightbus", "demo", "--rollout", "vllm", "--steps", "1"],
                         capture_output=True, text=True, timeout=600, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    lines = text.strip().splitlines()
    assert len(lines) <= 10, text
    assert "vLLM == transformers" in text and "WARNING" not in text and "INFO" not in text
    log = next(ln for ln in lines if ln.startswith("engine logs ("))
    path = log.rsplit(": ", 1)[1]
    assert os.path.getsize(path) > 0  # what was kept out is in the file
    os.unlink(path)
