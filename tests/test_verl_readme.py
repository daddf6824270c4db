"""The README's verl blocks (``<!-- run: verl-python -->``) run as written, against verl
itself (``make test-verl``); the main suite's ``tests/test_readme.py`` runs every other block."""

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed (make test-verl)")

from test_readme import blocks, run_block  # noqa: E402

VERL_BLOCKS = [b for b in blocks() if b.values[0].startswith("<!-- run: verl-python")]


@pytest.mark.parametrize("marker,lang,code", VERL_BLOCKS)
def test_readme_verl_block_runs(marker, lang, code, tmp_path, monkeypatch):
    import os
    for key in [k for k in os.environ if k.startswith("VERL_")]:  # (as a user runs it: not
        monkeypatch.delenv(key)                                    # test_verl.py's CPU platform)
    run_block(marker, code, tmp_path)


def test_there_is_a_verl_block():
    assert VERL_BLOCKS
