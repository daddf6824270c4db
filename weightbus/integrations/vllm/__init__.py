"""vLLM as the rollout engine (``pip install weightbus[vllm]``).

- :mod:`.native`: weightbus as vLLM's own weight-transfer backend ``weightbus``
  (``LLM(..., weight_transfer_config={"backend": "weightbus"})``; trainer side through
  ``WeightTransferTrainerFactory``). Registered in vLLM's workers by the
  ``vllm.general_plugins`` entry point :func:`register`.
- :mod:`.rollouts`: one handle per way of running vLLM (offline ``LLM``, ``AsyncLLM``,
  HTTP server) with pause / update / resume, and manager replicas.
- :mod:`.extension`: the ``worker_extension_cls`` fallback for older vLLMs.
- :mod:`.loader`: how an update lands in a vLLM model (checked first, layerwise reload).

Nothing here imports vLLM until it is used.
"""

from __future__ import annotations

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

__all__ = [
    "AsyncLLMRollout", "HTTPRollout", "OfflineLLMRollout", "Rollout", "RolloutClient",
    "VLLMEngineReplica", "VLLMReplica", "WeightbusWorkerExtension", "register", "sync_weights",
]


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make the ``weightbus`` backend known to
    vLLM's factories (vLLM runs it in every process it starts, workers included)."""
    from weightbus.integrations.vllm import native

    native.register()


def __getattr__(name: str) -> Any:  # the native classes import vLLM: load them on use
    if name in ("WeightbusTrainerInitInfo", "WeightbusTrainerEngine", "WeightbusWeightTransferEngine"):
        from weightbus.integrations.vllm import native
        return getattr(native, name)
    raise AttributeError(name)
