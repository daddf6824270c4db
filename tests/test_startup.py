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
    "import weightbus.cli as c\ntry:\n    c.main(['--help'])\nexcept SystemExit:\n    pass",
    "import weightbus.cli as c\ntry:\n    c.main(['--version'])\nexcept SystemExit:\n    pass",
    "import weightbus.cli as c\ntry:\n    c.main(['dmeo'])\nexcept SystemExit:\n    pass",
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


def _env_of(rank: int, key: str):
    import os
    return os.environ.get(key)


def test_workers_take_the_parents_environment_as_it_is_when_they_start(monkeypatch):
    """Local workers start from a fork server (started once, with the environment of then):
    each still runs with its parent's environment as it is when the worker starts."""
    from weightbus.runtime.group import LocalWorkerGroup, call
    from weightbus.runtime.local import spawn
    monkeypatch.delenv("WB_PROBE", raising=False)
    assert spawn(_env_of, 1, ("WB_PROBE",)) == [None]
    monkeypatch.setenv("WB_PROBE", "now")
    assert spawn(_env_of, 2, ("WB_PROBE",)) == ["now", "now"]
    group = LocalWorkerGroup(_Env, 1, env={"WB_OTHER": "given"})
    try:
        assert call(group, "get", "WB_PROBE", timeout=60) == ["now"]
        assert call(group, "get", "WB_OTHER", timeout=60) == ["given"]
    finally:
        group.shutdown()


class _Env:
    def __init__(self, rank, world):
        pass

    def get(self, key):
        import os
        return os.environ.get(key)
