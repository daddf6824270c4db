"""``weightbus demo --rollout vllm``: FSDP2 trainers -> a real vLLM engine, every update
checked against transformers. Skipped where vLLM is not installed.

One run of the command a newcomer runs (an engine start is most of its time): its rows
(also written as JSON) and what it prints are both checked."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm")


def test_vllm_demo_cli_verifies_every_update_and_keeps_engine_logs_out_of_the_table(tmp_path):
    """Two updates from two FSDP2 trainer ranks, each verified (vLLM == transformers) and
    carrying its version; printed: the table and one line naming the engine's log file,
    not vLLM's ~95 lines of logs and warnings around it (``--verbose`` prints them)."""
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    rows_file = tmp_path / "rows.json"
    out = subprocess.run([sys.executable, "-m", "weightbus", "demo", "--rollout", "vllm", "--steps", "2",
                          "--trainers", "2", "--dim", "128", "--layers", "2", "--json", str(rows_file)],
                         capture_output=True, text=True, timeout=600, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    rows = json.loads(rows_file.read_text())
    assert [r["version"] for r in rows] == ["1", "2"], rows
    assert all(r["verified"] for r in rows), rows
    lines = text.strip().splitlines()
    assert len(lines) <= 10, text
    assert text.count("vLLM == transformers") == 2 and "WARNING" not in text and "INFO" not in text
    log = next(ln for ln in lines if ln.startswith("engine logs ("))
    path = log.rsplit(": ", 1)[1]
    assert os.path.getsize(path) > 0  # what was kept out is in the file
    os.unlink(path)
