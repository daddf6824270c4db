"""The README is a contract: every Python block in README.md and docs/ runs as written
(under the launcher its ``<!-- run: ... -->`` line names), or is marked as a fragment
whose runnable twins exist and are run by CI; every shell block is such a fragment (its
commands are what CI itself runs). The low-level example runs here too."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```(python|bash|sh|shell)\n(.*?)^```", re.M | re.S)


def blocks():
    for doc in DOCS:
        for i, m in enumerate(BLOCK.finditer(doc.read_text())):
            yield pytest.param(m.group(1) or "", m.group(2), m.group(3), id=f"{doc.name}-{m.group(2)}-{i}")


def _env():
    # (the repository first; what the environment adds, e.g. a vLLM install, after it)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}


@pytest.mark.parametrize("marker,lang,code", list(blocks()))
def test_readme_block_runs_or_has_a_twin(marker, lang, code, tmp_path):
    twins = re.match(r"<!-- fragment: runnable twins? ([^(]+?)\s*(?:\(|-->)", marker)
    if twins:
        for twin in twins.group(1).split():
            assert (ROOT / twin).is_file(), f"the fragment's twin {twin} is missing"
        return
    assert lang == "python", f"a {lang} block must name its runnable twins (<!-- fragment: ... -->):\n{code}"
    if marker.startswith("<!-- run: vllm-python"):
        assert (ROOT / "tests" / "test_vllm_readme.py").is_file()
        pytest.skip("needs vLLM: the vLLM suite runs it (tests/test_vllm_readme.py)")
    if marker.startswith("<!-- run: verl-python"):
        assert (ROOT / "tests" / "test_verl_readme.py").is_file()
        pytest.skip("needs verl: make test-verl runs it (tests/test_verl_readme.py)")
    run_block(marker, code, tmp_path)


def run_block(marker, code, tmp_path, python=sys.executable):
    """Run one block as written, under the launcher its marker names."""
    script = tmp_path / "block.py"
    script.write_text(code)
    run = re.match(r"<!-- run: (.*?) -->", marker)
    launcher = run.group(1).split() if run else ["python"]
    if launcher[0] == "torchrun":
        launcher = [python, "-m", "torch.distributed.run", "--master-port", _port(), *launcher[1:]]
    elif launcher[0] in ("python", "vllm-python", "verl-python"):
        launcher = [python]
    out = subprocess.run([*launcher, str(script)], capture_output=True, text=True, timeout=300,
                         env=_env(), cwd=tmp_path)
    assert out.returncode == 0, \
        f"this README block fails as written:\n{code}\n{out.stdout}\n{out.stderr[-3000:]}"


def _port():
    from weightbus.comm import free_port
    return str(free_port())


def test_low_level_example_two_trainers_two_rollouts():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "low_level.py"), "--trainers", "2",
                          "--rollouts", "2"], capture_output=True, text=True, timeout=240, env=_env())
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    lines = [x for x in out.stdout.splitlines() if "version 3" in x]
    assert len(lines) == 4 and len({x.rsplit(" ", 1)[-1] for x in lines}) == 1  # every rank, same bits
