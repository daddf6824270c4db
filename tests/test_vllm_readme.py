"""The README's vLLM blocks (``<!-- run: vllm-python -->``) run as written, against a real
vLLM (CPU build); the main suite's ``tests/test_readme.py`` runs every other block."""

import os

import pytest

pytest.importorskip("vllm")

from test_readme import blocks, run_block  # noqa: E402

VLLM_BLOCKS = [b for b in blocks() if b.values[0].startswith("<!-- run: vllm-python")]


@pytest.mark.parametrize("marker,lang,code", VLLM_BLOCKS)
def test_readme_vllm_block_runs(marker, lang, code, tmp_path):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    run_block(marker, code, tmp_path)


def test_there_is_a_vllm_block():
    assert VLLM_BLOCKS
