"""Loading one update into a live vLLM model, the way vLLM's own weight-transfer engines
do, plus the two guarantees weightbus adds:

- **preflight**: before any byte is loaded, the update's manifest is dry-run through the
  model's own ``load_weights`` on meta tensors. vLLM's name mapping (fused ``qkv`` /
  ``gate_up``, tied embeddings, renames) and its weight loaders' shape checks run for
  real, but nothing is written. A name vLLM does not know, a shape its loader refuses, or
  a parameter the update would leave out or only half fill rejects the update before it
  starts, so the engine keeps serving the previous weights.
- **abort**: if the stream fails mid-way anyway (a trainer dies), layers whose weights
  were only partly received get their previous tensors back instead of being processed
  with uninitialised parts; layers already complete keep the new weights, so the model
  is then torn, which the caller reports by withdrawing its version.

Everything runs inside vLLM's layerwise-reload pair (``initialize_layerwise_reload`` /
``finalize_layerwise_reload``), which re-processes every updated layer (fused, repacked,
quantized) and keeps tensor addresses stable (CUDA graphs stay valid). Where vLLM's
processing takes a shortcut on reload (the CPU's MoE experts), :mod:`.processing`
rebuilds what it skips, and an optional self-check compares sampled layers with a fresh
load of the same weights before the update counts as done.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from weightbus.errors import WeightbusError
from weightbus.integrations.dryrun import load_into, loader_of, meta_copy, some
from weightbus.integrations.placement import Placement, Recorder
from weightbus.integrations.vllm import compat
from weightbus.integrations.vllm.processing import (
    RebuildHooks,
    SelfCheck,
    cpu_kernels,
    refresh_shared_cpu_kernels,
    self_check_from_env,
)
from weightbus.packing.shards import Box, ShardLayout
from weightbus.plan import Manifest

#: Ends the error of an update that failed before anything loaded.
KEPT = "vLLM kept its previous weights"
_log = logging.getLogger("vllm.weightbus")  # inside vLLM: printed with its own logs
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_WRAPPER = "online_process_loader"  # vLLM's layerwise wrapper around a weight loader


class RejectedUpdate(WeightbusError):
    """The update's manifest cannot be loaded into this vLLM model; nothing was loaded."""


def layerwise_reload() -> tuple[Any, Any] | None:
    """vLLM's ``(initialize_layerwise_reload, finalize_layerwise_reload)``, where this
    vLLM has them."""
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


class VLLMModelLoader:
    """One vLLM worker's model as the target of updates. The engine calls
    :meth:`preflight` with the manifest before any tensor is yielded; :meth:`receive`
    then runs the whole update. vLLM's layerwise reload begins at the first tensor and is
    finalized (or aborted) before :meth:`receive` returns, so the model never waits
    half-reloaded between two RPCs (a trainer that dies between ``start`` and ``finish``
    cannot leave vLLM's parameters on the meta device).

    Args:
        model: the worker's model (``model_runner.model``).
        model_config: vLLM's model config (finalize needs it for attention layers).
        partial: allow updates that leave some parameters out (they keep their values).
        where: names this worker in errors.
        self_check: compare sampled layers with a fresh load after updates (see
            :class:`~.processing.SelfCheck`); by default from ``WEIGHTBUS_VLLM_SELF_CHECK``.
        places: record where each tensor's bytes land at the preflight (:mod:`.placement`),
            so that the engine can write received regions in place (:meth:`layout`,
            :meth:`place`: sharded receive).
    """

    def __init__(self, model: torch.nn.Module, model_config: Any, *, partial: bool = False,
                 where: str = "vLLM worker", self_check: SelfCheck | None = None, places: bool = False):
        self.model, self.model_config = model, model_config
        self.partial, self.where = partial, where
        self._internals = _reload_internals()
        self.places = places and self._internals is not None
        self._placement: tuple[int, Placement] | None = None  # (manifest fingerprint, placement)
        self._placed_bytes = 0
        self.self_check = self_check if self_check is not None else self_check_from_env()
        self._reload = layerwise_reload()
        self._hooks: RebuildHooks | None = None
        self._kernels: dict[int, Any] = {}
        self._active = self._touched = False
        self._counted: _Counting | None = None
        #: (manifest fingerprint, loaders) -> (rejection reason, where its bytes land)
        self._verdicts: dict[tuple[int, int], tuple[str | None, Placement | None]] = {}
        #: seconds of the last update: in total, waiting for bytes, finalizing
        self.timing: dict[str, float] = {}

    @property
    def touched(self) -> bool:
        """Whether the last update had begun changing the model (a rejected one has not:
        its abort gives every layer its kernel tensors back)."""
        return self._touched

    def preflight(self, manifest: Manifest) -> None:
        """Raise :class:`RejectedUpdate` if this model cannot take ``manifest`` whole.
        Begins vLLM's layerwise reload: the dry run needs the model-format parameters it
        restores (on meta), as the kernel-format ones may have lost their loaders."""
        if not self._active:
            self._begin()
        self._placement = None
        fp = manifest.fingerprint
        key = (fp, _loaders_key(self.model))  # (a loader swapped since: checked and recorded anew)
        if key not in self._verdicts:
            begin = time.perf_counter()
            self._verdicts[key] = self._check(manifest)
            self.timing["preflight"] = time.perf_counter() - begin
            while len(self._verdicts) > 8:
                self._verdicts.pop(next(iter(self._verdicts)))
        reason, placement = self._verdicts[key]
        if reason:
            raise RejectedUpdate(f"{self.where}: {reason} [{KEPT}]")
        self._placement = (fp, placement) if placement is not None else None

    def _check(self, manifest: Manifest) -> tuple[str | None, Placement | None]:
        if not self._reload:
            return None, None
        if not self.places:
            return _dry_run(self.model, manifest, self.partial), None
        begin = time.perf_counter()
        recorder = Recorder()
        reason = _dry_run(self.model, manifest, self.partial, recorder)
        if reason:
            plain = _dry_run(self.model, manifest, self.partial)
            if plain is None:  # the tracked stand-ins failed, not the update: no placement
                _log.warning("weightbus %s: recording where each tensor lands failed (%s); this "
                             "manifest's tensors arrive whole", self.where, reason)
            return plain, None
        placement = recorder.result(manifest, _placeable)
        _log.info("weightbus %s: placement of manifest %#x recorded in %.3f s: %s", self.where,
                  manifest.fingerprint, time.perf_counter() - begin, placement.describe())
        return None, placement

    def layout(self, manifest: Manifest) -> ShardLayout | None:
        """The regions of ``manifest``'s tensors this worker keeps, as recorded from vLLM's
        loaders at the preflight (None: it takes every tensor whole)."""
        if self._placement is None or self._placement[0] != manifest.fingerprint:
            return None
        return self._placement[1].layout

    def place(self, name: str, box: Box, data: torch.Tensor, *, count: bool = True) -> None:
        """Write region ``box`` of update tensor ``name`` into the parameters vLLM's loaders
        would have written it to, inside the layerwise reload: the layer is materialized
        at its first region, and processed (and copied into its kernel tensors) by vLLM
        once every element of it is in, as a loader call would."""
        internals = self._internals
        if self._placement is None or internals is None:
            raise WeightbusError(f"{self.where}: region {box} of {name!r} arrived, but no placement is "
                                 f"recorded")
        layerwise_info, materialize, process = internals
        self._touched = True
        begin = time.perf_counter()
        for sc in self._placement[1].scatters.get(name, ()):
            inner = sc.box.intersect(box)
            if inner is None:
                continue
            info = layerwise_info.get(sc.layer)
            if info is None or not info.can_load():
                raise WeightbusError(f"{self.where}: region {inner} of {name!r} lands in {sc.layer_name}, "
                                     f"which vLLM has already processed in this update")
            param = getattr(sc.layer, sc.param)
            if param.is_meta:
                materialize(sc.layer, info)
                for fill in self._placement[1].fills.get(sc.layer, ()):  # (vocab padding zeroed)
                    fill.apply(getattr(sc.layer, fill.param))
                param = getattr(sc.layer, sc.param)
            sc.view(param)[inner.within(sc.box)].copy_(data[inner.within(box)])
            info.load_numel += inner.numel
            if info.load_numel >= info.load_numel_total:
                done = time.perf_counter()
                process(sc.layer, info)
                self.timing["processing"] += time.perf_counter() - done
        if count:  # (regions the engine writes: whole tensors of the stream are counted there)
            self._placed_bytes += data.numel() * data.element_size()
        spent = time.perf_counter() - begin
        self.timing["placing"] += spent
        if self._counted is not None and self._counted.reading:  # (called by the engine)
            self.timing["placing inside"] += spent

    def release(self, slot: torch.Tensor) -> None:
        """The engine is about to reuse ``slot`` (a bucket): vLLM's layerwise reload holds
        a layer's tensors until the layer is complete, so tensors of a layer that straddles
        buckets are still views of this one. Copy out those, and only those."""
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        storage = slot.untyped_storage().data_ptr()
        for info in list(LAYERWISE_INFO.values()):
            for _, bound in info.loaded_weights:
                for key, v in bound.arguments.items():
                    if isinstance(v, torch.Tensor) and v.device == slot.device and v.numel() \
                            and v.untyped_storage().data_ptr() == storage:
                        bound.arguments[key] = v.clone()

    def receive(self, stream: Iterable[tuple[str, torch.Tensor]], *, own: bool = False
                ) -> tuple[int, int]:
        """Load one update from ``stream`` into the model through ``model.load_weights``;
        returns (bytes, tensors). The stream is drained even if the model stops early, so
        the update completes on every rank. Pass the engine :meth:`release` as its
        ``on_release`` and :meth:`complete` as its ``on_complete`` (then a failed
        self-check fails the update on every rank); a stream that cannot call
        ``on_release`` must be given ``own=True`` (every view of a bucket is copied)."""
        counted = self._counted = _Counting(iter(stream), own=own and self._reload is not None)
        self._touched, self._placed_bytes = False, 0
        start = time.perf_counter()
        self.timing = dict.fromkeys(("preflight", "finalize", "check", "placing", "placing inside",
                                     "processing"), 0.0)
        items = self._loaded(counted)
        try:
            first = next(items, None)  # the header and the preflight come before it
            if first is not None:  # (None: no tensor left for load_weights, or all placed)
                if not self._active:  # (a stream without a preflight)
                    self._begin()
                self._touched = True
                self.model.load_weights(itertools.chain([first], items))
            for _ in items:  # the engine calls complete() before the ranks agree
                pass
            if self._active:  # a stream that does not call on_complete
                self.complete()
        except BaseException:
            self._abort()
            raise
        t = self.timing
        # (the engine places regions and finalizes while the stream is read: inside "waiting")
        inside = t["preflight"] + t["placing inside"] + \
            (t["finalize"] + t["check"] if counted.completed_inside else 0.0)
        t.update(seconds=time.perf_counter() - start, waiting=counted.waiting - inside)
        _log.info("weightbus %s: %.1f MB in %.3f s: %.3f s preflight, %.3f s waiting for bytes, %.3f s "
                  "in vLLM's load_weights, %.3f s placing regions (%.3f s of it vLLM processing layers), "
                  "%.3f s finalizing, %.3f s self-check", self.where,
                  (counted.bytes + self._placed_bytes) / 1e6, t["seconds"], t["preflight"], t["waiting"],
                  t["seconds"] - t["preflight"] - t["waiting"] - t["placing"] - t["finalize"] - t["check"],
                  t["placing"], t["processing"], t["finalize"], t["check"])
        return counted.bytes, counted.tensors

    def _loaded(self, stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors of ``stream`` that go through vLLM's loaders: a whole tensor whose
        placement is recorded is written in place here instead (its loader only places
        bytes), the rest are yielded (their loaders transform them)."""
        for name, t in stream:
            placement = self._placement
            if placement is not None and name in placement[1].scatters:
                self.place(name, Box.whole(t.shape), t, count=False)
            else:
                yield name, t

    def complete(self) -> None:
        """Every tensor is loaded: finish vLLM's reload (it processes the layers left),
        rebuild what it skips, and run the self-check if this update is sampled; raises
        :class:`~.processing.SelfCheckError` naming the layers that differ from a fresh
        load."""
        if not self._active:
            return
        if self._counted is not None:
            self._counted.completed_inside = self._counted.reading
        begin = time.perf_counter()
        hooks = self._hooks
        self._commit()
        checked = time.perf_counter()
        self.timing["finalize"] = checked - begin
        if hooks is not None and hooks.loaded:
            try:
                n = self.self_check.verify(self.model, hooks.loaded)  # type: ignore[union-attr]
            finally:
                hooks.loaded.clear()
                self.timing["check"] = time.perf_counter() - checked
            _log.info("weightbus %s: self-check passed on %d layer(s) in %.3f s", self.where, n,
                      self.timing["check"])

    def _begin(self) -> None:
        self._kernels = cpu_kernels(self.model)  # (which ones the update rebuilds: fresh)
        if self._reload:
            self._reload[0](self.model)
            sample = self.self_check.pick(self.model) if self.self_check else set()
            self._hooks = RebuildHooks(self.model, sample)
            self._hooks.install()
        self._active = True

    def _commit(self) -> None:
        self._active = False
        try:
            if self._reload:
                # (it warns for every layer that loaded nothing: a tied head, the rotary
                # embedding; the preflight has checked that the update is whole)
                with _quiet(_RELOAD_LOGGER):
                    self._reload[1](self.model, self.model_config)
        finally:
            self._remove_hooks()
        self._end_kernels()

    def _end_kernels(self) -> None:
        """After an update on the CPU: share the fresh GEMM kernels with tied twins, then
        free the replaced ones here, at a shallow stack. vLLM's oneDNN handler frees its
        packed weight in ``__del__``; left to the cyclic collector, that runs at whatever
        allocation next triggers a collection, possibly deep in a later call's stack: once
        in four CI runs (vLLM 0.32, TP=2) a TP worker died there of a C stack overflow, its
        ``__del__``'s ``.item()`` recursing through torch's error formatting."""
        refresh_shared_cpu_kernels(self.model, self._kernels)
        replaced = bool(self._kernels)
        self._kernels = {}
        if replaced:
            gc.collect()

    def _remove_hooks(self) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None

    def _abort(self) -> None:
        """End a failed update: layers that got only part of their weights keep their
        previous tensors."""
        if not self._active:
            return  # failed before the model was touched
        self._active = False
        if self._reload:
            from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
            for layer in self.model.modules():
                info = get_layerwise_info(layer)
                if info.can_load():  # never completed: drop what it buffered
                    info.loaded_weights.clear()
                    info.load_numel = 0
            try:
                with _quiet(_RELOAD_LOGGER):  # it warns once per layer that nothing was loaded
                    self._reload[1](self.model, self.model_config)
            finally:
                self._remove_hooks()
        self._end_kernels()


# ------------------------------------------------------------------ the dry run


def _reload_internals() -> tuple[Any, Any, Any] | None:
    """vLLM's layerwise-reload table, its layer materialization and its per-layer
    processing, which writing regions in place drives as a loader call would (vLLM's
    own sharded transfer engine drives the same ones); None where this vLLM lacks them."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO, _layerwise_process
        from vllm.model_executor.model_loader.reload.meta import materialize_layer
    except ImportError:
        return None
    return LAYERWISE_INFO, materialize_layer, _layerwise_process


def _loaders_key(model: torch.nn.Module) -> int:
    """Which weight loader every parameter has now (by identity): a loader swapped between
    two updates of the same manifest must be dry-run (and recorded) again."""
    out = []
    for mod in model.modules():
        for p in mod._parameters.values():
            if p is not None:
                f = _unwrapped(loader_of(p))
                out.append(id(getattr(f, "__func__", f)))
    return hash(tuple(out))


def _placeable(layer: torch.nn.Module, param: str) -> str | None:
    """Why a region recorded into ``param`` of ``layer`` cannot be written in place."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_MODULES
    if param in compat.skip_load_tensors() or type(layer).__name__ in SKIP_MODULES:
        return "vLLM's reload does not load it"
    if compat.is_deferred_attention(layer):
        return "vLLM processes attention layers at the end of an update"
    return None


def _optional(layer: torch.nn.Module, param: str) -> bool:
    """Whether vLLM's own load leaves ``param`` of ``layer`` out where a checkpoint lacks
    it: an attention layer's quantization scales (``q_scale``, ``k_scale``...: an fp8
    model's checkpoint may carry them; without them vLLM sets its defaults when it
    processes the layer)."""
    return param.endswith("_scale") and compat.is_deferred_attention(layer)


def _unwrapped(loader: Any) -> Any:
    while getattr(loader, "__name__", "") == _WRAPPER:
        loader = loader.__wrapped__
    return loader


def _dry_run(model: torch.nn.Module, manifest: Manifest, partial: bool,
             recorder: Recorder | None = None) -> str | None:
    """Run ``model.load_weights`` over meta tensors shaped like ``manifest``, with every
    parameter's (unwrapped) loader writing into a meta stand-in. Returns why the update
    would fail, or None. Called inside a layerwise reload, where parameters are already
    meta tensors; the few that stay real (``bias``) get a meta copy. With a ``recorder``,
    the stand-ins of the update's tensors are tracked (:mod:`.placement`)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    # parameters by identity, each with the storage of the kernel tensor it stands for: a
    # reload gives tied weights (lm_head, embed_tokens) separate meta stand-ins, but only
    # one of them is in the checkpoint
    params: dict[int, tuple[str, torch.Tensor]] = {}
    owner: dict[int, tuple[torch.nn.Module, str, str]] = {}
    storage: dict[int, int] = {}
    for mod_name, mod in model.named_modules():
        kernel = get_layerwise_info(mod).kernel_tensors
        for pname, p in mod._parameters.items():
            if p is None or id(p) in params:
                continue
            params[id(p)] = (f"{mod_name}.{pname}" if mod_name else pname, p)
            owner[id(p)] = (mod, mod_name, pname)
            k = kernel[0].get(pname) if kernel else None
            src = k if k is not None else p
            storage[id(p)] = src.data_ptr() if not src.is_meta else id(p)
    loaded: dict[int, int] = dict.fromkeys(params, 0)
    patched: list[tuple[torch.Tensor, bool, Any]] = []

    def stand_in_loader(key: int, original: Any, meta: torch.Tensor) -> Any:
        def load(param: Any, *args: Any, **kwargs: Any) -> Any:
            out, copied = load_into(meta, original, args, kwargs, recorder, owner[key])
            loaded[key] += copied
            return out
        return load

    for key, (_, p) in params.items():
        prev = loader_of(p)
        had = "weight_loader" in p.__dict__ or p.__dict__.get("_weight_loader") is not None
        meta = p if p.is_meta else meta_copy(p)
        p.weight_loader = stand_in_loader(key, _unwrapped(prev or default_weight_loader), meta)
        patched.append((p, had, prev))

    current = ["(none yet)"]

    def metas() -> Iterator[tuple[str, torch.Tensor]]:
        for m in manifest:
            current[0] = m.describe()
            yield m.name, (recorder.tracked(m.name, m.shape, m.dtype) if recorder is not None
                           else torch.empty(m.shape, dtype=m.dtype, device="meta"))

    try:
        try:
            with torch.no_grad():
                model.load_weights(metas())
        except (NotImplementedError, RuntimeError) as e:
            if "meta" in str(e) and "size" not in str(e):
                _log.warning(
                    "weightbus: cannot dry-run this model's loaders on meta tensors (%s); "
                    "the update is not checked before it loads", e)
                return None
            return f"vLLM's loader refuses tensor {current[0]}: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - reported as the reason
            if isinstance(e, (KeyError, AttributeError, IndexError)) or "no module or parameter" in str(e):
                # (the name looked up in the model: what failed is the name, not vLLM)
                return (f"vLLM's {type(model).__name__} does not know tensor {current[0]}: no parameter "
                        f"of its checkpoint format has that name (check the trainer's names, or the "
                        f"source's name_map); its loader raised {type(e).__name__}: {e}")
            return f"vLLM's loader refuses tensor {current[0]}: {type(e).__name__}: {e}"
    finally:
        for p, had, prev in patched:
            if had:
                p.weight_loader = prev
            else:
                with contextlib.suppress(Exception):
                    del p.weight_loader

    missing, half, filled = [], [], set()
    for key, (name, p) in params.items():
        want = int(getattr(p, "weight_loader_numel", p.numel()))
        got = min(loaded[key], want)
        if got == want:
            filled.add(storage[key])
        elif got:
            half.append(f"{name} ({got} of {want} elements)")
    for key, (name, p) in params.items():
        if storage[key] not in filled and not loaded[key] and p.numel() \
                and not _optional(owner[key][0], owner[key][2]):
            missing.append(name)
    if half:
        return f"the update fills only part of {len(half)} parameter(s): {some(half)}"
    if missing and not partial:
        return (f"the update leaves out {len(missing)} parameter(s) of the model: {some(missing)} "
                f"(pass partial=True to allow partial updates)")
    return None


@contextlib.contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    log = logging.getLogger(logger_name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class _Counting:
    def __init__(self, stream: Iterator[tuple[str, torch.Tensor]], own: bool = False):
        self.stream, self.own = stream, own
        self.bytes, self.tensors, self.waiting = 0, 0, 0.0
        self.reading = self.completed_inside = False  # (complete() called from inside the stream)

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        start = time.perf_counter()
        self.reading = True
        try:
            name, t = next(self.stream)
        finally:
            self.reading = False
            self.waiting += time.perf_counter() - start
        if self.own and t._base is not None:  # a view of a bucket slot
            t = t.clone()
        self.bytes += t.numel() * t.element_size()
        self.tensors += 1
        return name, t
