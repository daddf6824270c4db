"""The package's layers: no module imports one that (directly or not) imports it back, and
the public names users import from the engine API's former home still resolve."""

from __future__ import annotations

import ast
from pathlib import Path

import weightbus

ROOT = Path(weightbus.__file__).parent


def _modules() -> dict[str, set[str]]:
    """Module -> the weightbus modules it imports at import time (``TYPE_CHECKING`` blocks
    included: a cycle there is a cycle of the design)."""
    names = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in ROOT.rglob("*.py")}
    deps: dict[str, set[str]] = {}
    for name, path in names.items():
        found: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            for n in (node.body if isinstance(node, ast.If) else [node]):
                if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("weightbus"):
                    subs = {f"{n.module}.{a.name}" for a in n.names} & names.keys()
                    found |= subs or {n.module}
                elif isinstance(n, ast.Import):
                    found |= {a.name for a in n.names if a.name in names}
        deps[name] = {d for d in found if d in names and d != name}
    return deps


def test_no_import_cycles():
    deps = _modules()
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(deps[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(deps):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_former_engine_imports_still_work():
    from weightbus.engines import base, delta_gpu, delta_kernels
    from weightbus.engines.api import CheckpointEngine
    from weightbus.engines.bucket import BucketEngine
    from weightbus.engines.delta import cpu, gpu

    assert base.CheckpointEngine is CheckpointEngine and base.BucketEngine is BucketEngine
    assert delta_gpu is gpu and delta_kernels is cpu
