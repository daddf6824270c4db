"""The engine API's former home, kept so that existing imports keep working: the public
API is in :mod:`weightbus.engines.api`, the bucket protocol and its loops in
:mod:`weightbus.engines.bucket`, the sender's stream reading in :mod:`weightbus.engines.streams`."""

from weightbus.engines.api import (
    Batch,
    CheckpointEngine,
    CheckpointEngineRegistry,
    CheckpointEngineWithCache,
    Completion,
    Role,
    UpdateStats,
    Validator,
    Weights,
    WeightSource,
    WeightStream,
    agree_buffers,
    check_sides,
)
from weightbus.engines.bucket import BucketEngine
from weightbus.engines.streams import Stream, StreamBroken, fetch, resolve_stream

__all__ = ["Batch", "BucketEngine", "CheckpointEngine", "CheckpointEngineRegistry",
           "CheckpointEngineWithCache", "Completion", "Role", "Stream", "StreamBroken", "UpdateStats",
           "Validator", "WeightSource", "WeightStream", "Weights", "agree_buffers", "check_sides",
           "fetch", "resolve_stream"]
