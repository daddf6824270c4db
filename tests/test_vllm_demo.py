"""``weightbus demo --rollout vllm``: FSDP2 trainers -> a real vLLM engine, every update
checked against transformers. Skipped where vLLM is not installed."""

import pytest

pytest.importorskip("vllm")


def test_vllm_demo():
    from weightbus.integrations.vllm.demo import run_vllm_demo

    rows = run_vllm_demo(trainers=2, steps=2, hidden=128, layers=2)
    assert [r["version"] for r in rows] == ["1", "2"]
    assert all(r["verified"] for r in rows), rows
