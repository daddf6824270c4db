"""weightbus: move model weights from trainer ranks to rollout engines, fast and safely.

Layers (imports only go downward): plan -> buffers/comm -> engines -> sources/sinks ->
runtime -> manager -> cli. See docs/DESIGN.md.

The names below are imported when first used (``import weightbus`` alone imports neither
torch nor any backend): a command line that only prints its help starts at once.
"""

from __future__ import annotations

import importlib
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
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'weightbus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # (imported once)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
