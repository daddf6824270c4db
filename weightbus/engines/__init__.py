"""Layer 3: engines. Importing this package registers every built-in backend."""

from weightbus.engines import cache, collective, colocated, mooncake, nixl  # noqa: F401  (registration)
from weightbus.engines.base import (
    BucketEngine,
    CheckpointEngine,
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    UpdateStats,
)

__all__ = ["BucketEngine", "CheckpointEngine", "CheckpointEngineRegistry",
           "CheckpointEngineWithCache", "UpdateStats"]
