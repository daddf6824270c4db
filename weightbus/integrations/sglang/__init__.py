"""SGLang as a rollout engine: weightbus updates an ``sglang.Engine`` in place.

- :class:`SGLangReplica`: an engine as one replica of
  :class:`weightbus.manager.CheckpointEngineManager` (pause, update with any weightbus
  engine, flush, set the version, resume; hybrid sleep and wake-up);
- :func:`engine_args`: the engine's keyword arguments with weightbus's hook added
  (SGLang's ``custom_weight_loader``: how weightbus runs in every TP worker, :mod:`.worker`).

Importing this package does not import SGLang.
"""

from weightbus.integrations.sglang.replica import PAUSE_MODES, SGLangReplica, engine_args
from weightbus.integrations.sglang.worker import HOOK, dry_run

__all__ = ["HOOK", "PAUSE_MODES", "SGLangReplica", "dry_run", "engine_args"]
