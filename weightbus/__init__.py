"""weightbus: move model weights from trainer ranks to rollout engines, fast and safely.

Layers (imports only go downward): plan -> packing (buffers, shards, native copies) and
comm -> engines -> sources/sinks -> runtime -> manager -> integrations -> tools (cli, demo,
bench). Beside them: quant (fp8 on the wire) and planning (planner, simulate, cluster,
topology, presets). See docs/DESIGN.md.

The names below are imported when first used (``import weightbus`` alone imports neither
torch nor any backend): a command line that only prints its help starts at once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: each public name, and the module that defines it
_EXPORTS = {
    "CheckpointEngine": "weightbus.engines",
    "CheckpointEngineRegistry": "weightbus.engines",
    "CheckpointEngineWithCache": "weightbus.engines",
    "UpdateStats": "weightbus.engines",
    "WeightSource": "weightbus.engines.api",
    "WeightStream": "weightbus.engines.api",
    "ConfigError": "weightbus.errors",
    "ManifestMismatch": "weightbus.errors",
    "PlanError": "weightbus.errors",
    "SinkError": "weightbus.errors",
    "UpdateFailed": "weightbus.errors",
    "WeightbusError": "weightbus.errors",
    "WeightSyncError": "weightbus.errors",
    "BucketPlan": "weightbus.plan",
    "Manifest": "weightbus.plan",
    "TensorMeta": "weightbus.plan",
    "ModuleSink": "weightbus.sinks",
    "ModuleSource": "weightbus.sources",
}

__all__ = [
    "BucketPlan", "CheckpointEngine", "CheckpointEngineRegistry", "CheckpointEngineWithCache", "ConfigError",
    "Manifest", "ManifestMismatch", "ModuleSink", "ModuleSource", "PlanError", "SinkError", "TensorMeta",
    "UpdateFailed", "UpdateStats", "WeightSource", "WeightStream", "WeightSyncError", "WeightbusError",
]

if TYPE_CHECKING:
    from weightbus.engines import (
        CheckpointEngine,
        CheckpointEngineRegistry,
        CheckpointEngineWithCache,
        UpdateStats,
    )
    from weightbus.engines.api import WeightSource, WeightStream
    from weightbus.errors import (
        ConfigError,
        ManifestMismatch,
        PlanError,
        SinkError,
        UpdateFailed,
        WeightbusError,
        WeightSyncError,
    )
    from weightbus.plan import BucketPlan, Manifest, TensorMeta
    from weightbus.sinks import ModuleSink
    from weightbus.sources import ModuleSource


def __getattr__(name: str) -> Any:
    if name in _MOVED:  # (an old module name: ``from weightbus import buffers``)
        return importlib.import_module(f"weightbus.{name}")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (imported once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


#: modules that moved into the packages above, by their old names: ``import weightbus.buffers``
#: and ``from weightbus import planner`` keep working (the same module object, not a copy)
_MOVED = {
    "planner": "planning.planner", "simulate": "planning.simulate", "cluster": "planning.cluster",
    "topology": "planning.topology", "presets": "planning.presets", "quant_triton": "quant.kernels",
    "cli": "tools.cli", "demo": "tools.demo", "bench": "tools.bench", "buffers": "packing.buffers",
    "native": "packing.native", "copy_triton": "packing.copy_triton", "shards": "packing.shards",
}


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``weightbus.<old name>`` as the module it moved to."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        old = fullname.removeprefix("weightbus.")
        if fullname.startswith("weightbus.") and old in _MOVED:
            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec: Any) -> Any:
        return importlib.import_module("weightbus." + _MOVED[spec.name.removeprefix("weightbus.")])

    def exec_module(self, module: Any) -> None:
        pass  # (the module it moved to ran on import)


sys.meta_path.append(_Moved())
