"""What vLLM derives from the weights it loads, and making an update rebuild all of it.

On a first load, every layer's ``quant_method.process_weights_after_loading`` turns the
checkpoint-format tensors into the format its kernel runs on (fused, transposed,
repacked, padded, quantized). vLLM's layerwise reload runs the same hook again for each
updated layer, then copies the result into the kernel tensors the model already holds,
so an update ends where a fresh load would: except where a hook takes a shortcut on
reload. Known shortcuts, read from vLLM 0.32's sources:

- **Unquantized fused MoE** (``UnquantizedFusedMoEMethod._setup_kernel``): once its
  kernel exists, a reload re-runs the backend's weight conversion
  (``convert_to_unquantized_kernel_format``: the AITER shuffle, FlashInfer's w13 -> w31
  swap and TRT-LLM block layout on GPUs) but skips the experts' own
  ``process_weights_after_loading``. On GPUs that hook is a no-op for every unquantized
  experts class (Triton, TRT-LLM bf16, FlashInfer CUTLASS, AITER, XPU), so updates there
  are right; MoonEP refuses in-place reloads outright. On the CPU the hook pads the
  intermediate size and prepacks both expert weights into the grouped-GEMM layout, so an
  update left raw weights where the kernel reads packed ones: wrong tokens, no error.
  :class:`RebuildHooks` runs the skipped hook, on the freshly loaded layer, before vLLM
  copies it into the kernel tensors. Quantized MoE methods always run their experts'
  hook; nothing to add there.
- **Tied heads on the CPU**: a module that only shares another's weight (``lm_head``
  tied to the embedding) loads nothing, so its oneDNN-packed GEMM is never rebuilt:
  :func:`refresh_shared_cpu_kernels` repacks it.

Whatever else a future vLLM derives and skips, :class:`SelfCheck` catches: it re-runs the
*first-load* processing on a private copy of a sample of updated layers, from the very
tensors the update delivered, and compares everything the live layer holds (every
tensor bitwise, and a linear layer's output on a fixed probe) with it.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch

from weightbus.errors import ConfigError

_log = logging.getLogger("vllm.weightbus")

#: Run the experts' hook that vLLM's unquantized MoE skips on reload. Tests turn it off
#: to prove the self-check sees the damage; nothing else should.
REBUILD_SKIPPED_HOOKS = True


def self_check_from_env() -> SelfCheck | None:
    """``WEIGHTBUS_VLLM_SELF_CHECK=N[:L]``: check every N-th update, L layers each time
    (all when L is left out); unset or 0: off."""
    raw = os.environ.get("WEIGHTBUS_VLLM_SELF_CHECK", "").strip()
    if not raw:
        return None
    try:
        every, _, layers = raw.partition(":")
        check = SelfCheck(int(every), int(layers or 0))
    except ValueError as e:
        raise ConfigError(f"WEIGHTBUS_VLLM_SELF_CHECK={raw!r}: expected N or N:L (check every N-th "
                         f"update, L layers each time), with N, L >= 0 ({e})") from None
    return check if check.every else None


class SelfCheckError(RuntimeError):
    """A layer holds something other than what a fresh load of the same weights would."""


def _layer_tensors(layer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, t in [*layer._parameters.items(), *layer._buffers.items()]:
        if t is not None:
            yield name, t


def _quant_method(layer: torch.nn.Module) -> Any:
    method = getattr(layer, "quant_method", None)
    return method if method is not None and hasattr(method, "process_weights_after_loading") else None


def _skipped_experts_hook(method: Any) -> Any:
    """The experts' ``process_weights_after_loading`` that ``method`` will skip on this
    reload, or None. Only vLLM's unquantized MoE method skips it (see the module doc),
    and only once its kernel exists; the base class's hook is a no-op."""
    if type(method).__name__ != "UnquantizedFusedMoEMethod":
        return None
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    try:
        from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts
        base = FusedMoEExperts.process_weights_after_loading
    except ImportError:  # pragma: no cover - another vLLM layout: assume it does work
        base = None
    if getattr(type(experts), "process_weights_after_loading", base) is base:
        return None
    return experts.process_weights_after_loading


def fresh_quant_method(method: Any) -> Any:
    """A copy of ``method`` in the state it had before the first load processed the
    layer: MoE methods build their kernel (and drop their quant config) then."""
    fresh = _private_copy(method)
    for attr in ("moe_kernel", "moe_quant_config"):
        if hasattr(fresh, attr):
            setattr(fresh, attr, None)
    return fresh


def _private_copy(obj: Any) -> Any:
    """A shallow copy whose attribute tables are its own: setting an attribute (or a
    parameter, buffer or submodule of an ``nn.Module``, which vLLM's quant methods are
    too) on the copy never reaches the original."""
    out = copy.copy(obj)
    out.__dict__ = dict(obj.__dict__)
    if isinstance(obj, torch.nn.Module):
        out._parameters, out._buffers = dict(obj._parameters), dict(obj._buffers)
        out._modules = dict(obj._modules)
        out._non_persistent_buffers_set = set(obj._non_persistent_buffers_set)
    return out


def _clone(t: torch.Tensor) -> torch.Tensor:
    """A copy of a (vLLM parameter) tensor that keeps its class and attributes (its
    weight loader and the like), as vLLM's own layer materialization does."""
    out = t.detach().clone()
    out.__class__ = t.__class__
    out.__dict__ = t.__dict__.copy()
    return out


class RebuildHooks:
    """Installed on every processed layer for one update (vLLM's layerwise reload calls
    ``quant_method.process_weights_after_loading(layer)`` on the materialized layer, with
    the update's tensors loaded, just before copying it into the kernel tensors). Runs
    the hooks vLLM skips on reload, and keeps the loaded tensors of the layers the
    self-check samples."""

    def __init__(self, model: torch.nn.Module, sample: set[str] | None = None):
        self.model = model
        self.sample = sample or set()
        #: sampled layer name -> the tensors it was loaded with (checkpoint format)
        self.loaded: dict[str, dict[str, tuple[torch.Tensor, bool]]] = {}
        self._installed: list[Any] = []

    def install(self) -> None:
        for name, layer in self.model.named_modules():
            method = _quant_method(layer)
            if method is None or "process_weights_after_loading" in method.__dict__:
                continue
            method.process_weights_after_loading = self._wrap(name, method)
            self._installed.append(method)

    def remove(self) -> None:
        for method in self._installed:
            method.__dict__.pop("process_weights_after_loading", None)
        self._installed = []

    def _wrap(self, name: str, method: Any) -> Any:
        original = type(method).process_weights_after_loading.__get__(method)

        def process_weights_after_loading(layer: torch.nn.Module) -> None:
            if name in self.sample:
                self.loaded[name] = {n: (_clone(t), n in layer._parameters)
                                     for n, t in _layer_tensors(layer)}
            skipped = _skipped_experts_hook(method)  # looked at before: it builds the kernel
            original(layer)
            if skipped is not None and REBUILD_SKIPPED_HOOKS:
                skipped(layer)

        return process_weights_after_loading


class SelfCheck:
    """After an update, compare a sample of layers with a fresh load of the same weights.

    For each sampled layer, the tensors the update loaded into it are kept (a copy, for
    the sample only); after vLLM has finished the update, a private shallow copy of the
    layer gets those tensors and a first-load copy of its quant method, whose
    ``process_weights_after_loading`` then runs as on a fresh load. Every parameter and
    buffer of the live layer must equal the copy's bitwise, and a linear layer must give
    the same output on a fixed probe (on the CPU its weight lives in a packed kernel).

    Cost: each sampled layer's weights are held twice more while it runs (the copy of
    what it loaded, and the fresh processing of it), so sample a few layers of a large
    model (``layers``); all layers of a model double its memory for the check (a 3.7 GB
    MoE with every layer sampled ran this 24 GiB machine out of memory).

    Args:
        every: check every N-th update (0: never).
        layers: layers per check (0: all); the sample rotates so that successive checks
            cover every layer.
    """

    def __init__(self, every: int = 0, layers: int = 0):
        if every < 0 or layers < 0:
            raise ValueError(f"self-check: every and layers must be >= 0, got {every}, {layers}")
        self.every, self.layers = every, layers
        self._updates = 0
        self._offset = 0

    def pick(self, model: torch.nn.Module) -> set[str]:
        """Layers to sample in the coming update (empty when it is not checked)."""
        self._updates += 1
        if not self.every or self._updates % self.every:
            return set()
        names = [n for n, m in model.named_modules() if _quant_method(m) is not None
                 and any(True for _ in _layer_tensors(m))]
        if not self.layers or self.layers >= len(names):
            return set(names)
        picked = {names[(self._offset + i * len(names) // self.layers) % len(names)]
                  for i in range(self.layers)}
        self._offset += 1
        return picked

    def verify(self, model: torch.nn.Module, loaded: dict[str, dict[str, tuple[torch.Tensor, bool]]]
               ) -> int:
        """Raise :class:`SelfCheckError` naming every layer that differs from a fresh load;
        returns how many layers were checked."""
        modules = dict(model.named_modules())
        bad = []
        for name, tensors in loaded.items():
            why = _compare_with_fresh(modules[name], tensors)
            if why:
                bad.append(f"{name} ({type(modules[name]).__name__}): {why}")
        if bad:
            raise SelfCheckError(
                f"self-check: {len(bad)} of {len(loaded)} sampled layer(s) hold something other than "
                f"a fresh load of the same weights would: " + "; ".join(bad[:5]))
        return len(loaded)


def _compare_with_fresh(layer: torch.nn.Module, loaded: dict[str, tuple[torch.Tensor, bool]]) -> str | None:
    method = _quant_method(layer)
    shadow = _private_copy(layer)
    shadow._parameters, shadow._buffers = {}, {}
    for n, (t, is_param) in loaded.items():
        (shadow._parameters if is_param else shadow._buffers)[n] = _clone(t)
    fresh = fresh_quant_method(method)
    shadow.quant_method = fresh
    try:
        with torch.no_grad():
            fresh.process_weights_after_loading(shadow)
    except Exception as e:  # noqa: BLE001 - this layer cannot be checked this way
        _log.warning("weightbus self-check: cannot re-process %s as a fresh load: %s",
                     type(layer).__name__, e)
        return None
    live = dict(_layer_tensors(layer))
    want = dict(_layer_tensors(shadow))
    diffs = [f"{n} missing after the update" for n in want if n not in live]
    for n, w in want.items():
        got = live.get(n)
        if got is not None and not _same_bits(got, w):
            diffs.append(f"{n} differs ({_describe(got)} vs fresh {_describe(w)})")
    if not diffs:
        why = _probe(method, layer, fresh, shadow)
        if why:
            diffs.append(why)
    return "; ".join(diffs) or None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    a, b = a.detach().contiguous().reshape(-1), b.detach().to(a.device).contiguous().reshape(-1)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _probe(method: Any, layer: torch.nn.Module, fresh: Any, shadow: torch.nn.Module) -> str | None:
    """Linear layers: the kernel's output on a fixed input, live against fresh (on the
    CPU the weight itself lives in a packed kernel, not in a tensor we can compare)."""
    try:
        from vllm.model_executor.layers.linear import LinearMethodBase
    except ImportError:  # pragma: no cover
        return None
    n_in = getattr(layer, "input_size_per_partition", None)
    if not isinstance(method, LinearMethodBase) or not n_in:
        return None
    ref = next((t for _, t in _layer_tensors(layer) if t.is_floating_point()), None)
    if ref is None:
        return None
    gen = torch.Generator(device="cpu").manual_seed(0)
    dtype = getattr(layer, "params_dtype", ref.dtype)
    x = torch.randn(3, int(n_in), generator=gen).to(device=ref.device, dtype=dtype)
    with torch.no_grad():
        got, want = method.apply(layer, x), fresh.apply(shadow, x)
    if not _same_bits(got, want):
        err = (got.float() - want.float()).abs().max().item()
        return f"its output on a fixed probe differs from a fresh load's (max abs diff {err:.3g})"
    return None


def cpu_kernels(model: Any) -> dict[int, Any]:
    """Each module's CPU GEMM kernel (``cpu_linear``) now, by module identity: what
    :func:`refresh_shared_cpu_kernels` compares with after an update."""
    return {id(m): m.cpu_linear for m in model.modules() if hasattr(m, "cpu_linear")}


def refresh_shared_cpu_kernels(model: Any, before: dict[int, Any] | None = None) -> None:
    """On the CPU, vLLM packs each linear weight into a GEMM kernel when it loads. A module
    that only shares another's weight (a tied ``lm_head``) loads nothing itself, so a
    reload leaves its kernel packed from the old weights. Give it the kernel its twin got
    in this update (``before``: :func:`cpu_kernels` at the start; a kernel is fresh where it
    changed since), or pack one anew where no twin's is fresh; the twins then share it.

    A kernel closes over the packed weight only (the weight and bias are the call's
    arguments), so twins share one when their weight is the same view and neither has a
    bias; any other module is packed on its own."""
    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
        return
    by_storage: dict[int, list[Any]] = {}  # (with or without a kernel: the one that loaded
    for m in model.modules():               # the weight may have none of its own)
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.ndim == 2 and w.numel():
            by_storage.setdefault(w.data_ptr(), []).append(m)
    for mods in by_storage.values():
        if len(mods) < 2:
            continue
        kernels = [m for m in mods if hasattr(m, "cpu_linear")]
        fresh = [m for m in kernels if before is not None and m.cpu_linear is not before.get(id(m))]
        for m in kernels:
            if m in fresh:
                continue
            twin = next((f for f in fresh if _same_view(f, m)), None)
            if twin is None:
                dispatch_cpu_unquantized_gemm(m, remove_weight=False)
                fresh.append(m)
            else:
                m.cpu_linear = twin.cpu_linear


def _same_view(a: Any, b: Any) -> bool:
    def view(w: torch.Tensor) -> tuple[Any, ...]:
        return w.data_ptr(), w.shape, w.stride(), w.dtype
    return view(a.weight) == view(b.weight) and getattr(a, "bias", None) is None \
        and getattr(b, "bias", None) is None
