"""Starting is instant: ``import weightbus`` and ``weightbus --help`` import neither torch
nor any backend (Ray, vLLM, Triton, NIXL, Mooncake); the public names load when first used."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "ray", "vllm", "triton", "nixl", "mooncake", "sglang", "numpy")


def imported_after(code: str) -> list[str]:
    probe = (f"import sys\n{code}\n"
             f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [
    "import weightbus",
    "import weightbus; weightbus.__version__; dir(weightbus)",
    "import weightbus.tools.cli as c\ntry:\n    c.main(['--help'])\nexcept SystemExit:\n    pass",
    "import weightbus.tools.cli as c\ntry:\n    c.main(['--version'])\nexcept SystemExit:\n    pass",
    "import weightbus.tools.cli as c\ntry:\n    c.main(['dmeo'])\nexcept SystemExit:\n    pass",
])
def test_starting_imports_nothing_heavy(code):
    assert imported_after(code) == []


def test_public_names_load_when_used():
    import weightbus
    assert sorted(weightbus.__all__) == sorted(weightbus._EXPORTS)
    for name in weightbus.__all__:
        assert getattr(weightbus, name).__name__ == name
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        weightbus.Nope  # noqa: B018
