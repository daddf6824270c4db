"""Layer 3: engines. Importing this package registers every built-in backend."""

from weightbus.engines import cache, collective, colocated, mooncake, nixl  # noqa: F401  (registration)
from weightbus.engines.api import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    UpdateStats,
)
from weightbus.engines.bucket import BucketEngine

__all__ = ["BucketEngine", "CheckpointEngine", "CheckpointEngineRegistry",
           "CheckpointEngineWithCache", "UpdateStats"]

#: delta mode's modules before they became one package (``weightbus.engines.delta``)
_MOVED = {"delta_gpu": "weightbus.engines.delta.gpu", "delta_kernels": "weightbus.engines.delta.cpu",
          "delta_triton": "weightbus.engines.delta.gpu_triton"}


def __getattr__(name: str) -> object:
    """``from weightbus.engines import delta_gpu`` (and the other former names) still works."""
    if name in _MOVED:
        import importlib

        return importlib.import_module(_MOVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

