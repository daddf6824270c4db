"""benchmarks/RESULTS.md opens with the table `benchmarks/current.py` writes from the result
files (value, floor, ratio, device, the command, the commit, whether the code changed since):
a result added or code changed without rewriting it fails here, saying what to run."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_current_table_is_current():
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("needs the repository's history (the commit that recorded each result)")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "current.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
