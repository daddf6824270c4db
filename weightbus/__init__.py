"""weightbus: move model weights from trainer ranks to rollout engines, fast and safely.

Layers (imports only go downward): plan -> buffers/comm -> engines -> sources/sinks ->
runtime -> manager -> cli. See docs/DESIGN.md.
"""

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

__version__ = "0.1.0"

__all__ = [
    "BucketPlan", "CheckpointEngine", "ConfigError", "CheckpointEngineRegistry", "CheckpointEngineWithCache",
    "Manifest", "ManifestMismatch", "ModuleSink", "ModuleSource", "PlanError", "SinkError",
    "TensorMeta", "UpdateFailed", "UpdateStats", "WeightSource", "WeightStream", "WeightSyncError",
    "WeightbusError",
]
