"""vLLM as the rollout engine (``pip install weightbus[vllm]``; vLLM 0.24 to 0.33).

- :mod:`.native`: weightbus as vLLM's own weight-transfer backend ``weightbus``
  (``LLM(..., weight_transfer_config={"backend": "weightbus"})``), registered in vLLM's
  workers by the ``vllm.general_plugins`` entry point :func:`register`.
- :mod:`.trainer`: its trainer side, :func:`trainer_init` (one call on every vLLM
  version; no vLLM needed in the trainer's process).
- :mod:`.compat`: every difference between the vLLM versions, in one place.
- :mod:`.rollouts`: one handle per way of running vLLM (offline ``LLM``, ``AsyncLLM``,
  HTTP server) with pause / update / resume, and manager replicas.
- :mod:`.extension`: the ``worker_extension_cls`` fallback for older vLLMs.
- :mod:`.loader`: how an update lands in a vLLM model (checked first, layerwise reload).

Nothing here imports vLLM until it is used.
"""

from __future__ import annotations

import logging
from typing import Any

from weightbus.integrations.vllm.extension import WeightbusWorkerExtension
from weightbus.integrations.vllm.rollouts import (
    AsyncLLMRollout,
    HTTPRollout,
    OfflineLLMRollout,
    Rollout,
    RolloutClient,
    VLLMEngineReplica,
    VLLMReplica,
    sync_weights,
)
from weightbus.integrations.vllm.trainer import WeightbusTrainerEngine, WeightbusTrainerInitInfo, trainer_init

__all__ = [
    "AsyncLLMRollout", "HTTPRollout", "OfflineLLMRollout", "Rollout", "RolloutClient",
    "VLLMEngineReplica", "VLLMReplica", "WeightbusTrainerEngine", "WeightbusTrainerInitInfo",
    "WeightbusWorkerExtension", "register", "sync_weights", "trainer_init",
]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make the ``weightbus`` backend known to
    vLLM's factories (vLLM runs it in every process it starts, workers included).

    It never raises: vLLM calls plugins unguarded while it builds an engine, so a raise
    here would stop every vLLM engine of the environment, weightbus's or not. Where this
    vLLM cannot host the backend (older than 0.24, or an import fails), it logs one line
    naming the version and the way that works instead, and vLLM starts as without it."""
    from weightbus.integrations.vllm import compat

    version = compat.installed_version()
    note = compat.support_note(version)
    try:
        from weightbus.integrations.vllm import native
        native.register()
    except Exception as e:  # noqa: BLE001 - never into vLLM's plugin loader
        compat.say_once("register", "weightbus: the 'weightbus' weight-transfer backend is not available "
                        "in vLLM %s (%s: %s). %s", version, type(e).__name__, e,
                        note or "The worker-extension path (WeightbusWorkerExtension) still works.",
                        level=logging.WARNING)
        return
    if note:
        compat.say_once("register", "weightbus: %s", note, level=logging.WARNING)


def __getattr__(name: str) -> Any:  # the worker class imports vLLM: load it on use
    if name == "WeightbusWeightTransferEngine":
        from weightbus.integrations.vllm import native
        return native.WeightbusWeightTransferEngine
    raise AttributeError(name)
