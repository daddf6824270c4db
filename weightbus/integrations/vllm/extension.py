"""The fallback worker side for vLLMs without the native weight-transfer API: every vLLM
worker mixes in :class:`WeightbusWorkerExtension` and the manager reaches it through
``collective_rpc`` (driven by :class:`~weightbus.integrations.vllm.rollouts.VLLMReplica`)::

    llm = LLM(model=path, worker_extension_cls="weightbus.integrations.vllm.WeightbusWorkerExtension")
    mgr = CheckpointEngineManager("gloo", trainer, [VLLMReplica(llm, name="vllm0")])
    mgr.update_weights(version=step)                    # lands in vLLM's own load_weights

Every vLLM worker (one per TP rank) joins the weightbus group as one rollout rank and
feeds the received stream to ``model.load_weights`` through :class:`.loader.VLLMModelLoader`.
Tensors cannot travel as ``collective_rpc`` arguments; only small control values do.

Delta mode (``CheckpointEngineManager(..., delta=True)``): patches need the previous
version of every tensor *as it travels* (Hugging Face names and layouts), which vLLM does
not keep (it fuses q/k/v and gate/up, shards over TP, may repack for its kernels). Each
worker therefore keeps a shadow copy of the update's tensors on the engine's device: the
engine patches the shadow in place (digest-checked), then the whole shadow goes through
vLLM's own ``load_weights``, like a dense update. The wire carries only the changes; the
cost is one copy of the weights in the wire dtype per worker, and a full load per update.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightbus.integrations.outcomes import FAILED
from weightbus.integrations.vllm.loader import VLLMModelLoader
from weightbus.plan import Manifest
from weightbus.worker import EngineHost


class WeightbusWorkerExtension(EngineHost):
    """Mixed into every vLLM worker by ``worker_extension_cls``; reached through
    ``collective_rpc``. ``self.rank`` and ``self.model_runner`` are vLLM's. It adds to
    :class:`EngineHost` only engine set-up on the model's device and receiving into
    vLLM's ``load_weights``; it defines no name vLLM's worker has (``sleep``...), which
    vLLM refuses. The offline engine generates only inside ``llm.generate()``, which the
    caller does not run during an update, so pausing is a no-op."""

    def wb_dispatch(self, method: str, args: Sequence[tuple] | None, kwargs: Sequence[dict] | None) -> Any:
        """Run ``method`` with this rank's share of per-rank arguments. A failure comes
        back as ``{FAILED: reason}``, never as a raise: vLLM's executor would pass on the
        first failing worker's and leave the other workers' replies queued for the next
        call (see :mod:`weightbus.integrations.outcomes`)."""
        rank = int(getattr(self, "rank", 0))
        a = tuple(args[rank]) if args else ()
        k = dict(kwargs[rank]) if kwargs else {}
        try:
            return getattr(self, method)(*a, **k)
        except Exception as e:  # noqa: BLE001 - reported in the reply (VLLMReplica raises it)
            return {FAILED: f"{type(e).__name__}: {e}"}

    def wb_setup(self, backend: str, role: str, engine_kwargs: dict[str, Any],
                 replica: str | None = None) -> None:
        kwargs = dict(engine_kwargs)
        if backend in ("nccl", "colocated") and "device" not in kwargs:
            kwargs["device"] = str(next(self.model_runner.model.parameters()).device)  # type: ignore[attr-defined]
        super().wb_setup(backend, "rollout", kwargs, replica)

    def wb_receive(self, version: int) -> dict[str, Any]:
        """Stream one update straight into vLLM's ``load_weights`` (synchronous:
        ``collective_rpc`` runs plain methods). A manifest the model cannot take is
        rejected before anything loads (see :mod:`.loader`)."""
        assert self._wb_engine is not None, "wb_setup first"
        rank = getattr(self, "rank", 0)
        previous, self.weights_version = self.weights_version, None
        loader = self.__dict__.get("_wb_loader")
        if loader is None:  # kept: it caches its verdict per manifest
            loader = self._wb_loader = VLLMModelLoader(
                self.model_runner.model, self.model_runner.model_config,  # type: ignore[attr-defined]
                where=f"vLLM rank {rank}")
        validate: Callable[[Manifest], None] = loader.preflight
        if getattr(self._wb_engine, "delta", False):
            def validate(manifest: Manifest) -> None:
                loader.preflight(manifest)
                self._wb_shadow(manifest)
        try:
            stream = self._wb_engine.receive_weights_sync(validate=validate,
                                                             on_release=loader.release,
                                                             on_complete=loader.complete)
            try:
                nbytes, tensors = loader.receive(stream)
            finally:
                stream.close()  # type: ignore[attr-defined]
        except BaseException:
            if not loader.touched:  # rejected up front: the previous weights are intact
                self.weights_version = previous
            raise
        if self._wb_engine.version != version:
            raise RuntimeError(f"vLLM rank {rank}: received version {self._wb_engine.version}, "
                               f"expected {version}")
        self.weights_version = version
        return {"bytes": nbytes, "tensors": tensors}

    def _wb_shadow(self, manifest: Manifest) -> None:
        """Delta mode: the engine's destinations, a copy of the update's tensors on the
        engine's device (the model's for nccl), made anew when the tensors change (a new
        shadow holds no version, and a changed manifest makes the update dense anyway)."""
        engine, fp = self._wb_engine, manifest.tensors_fingerprint
        shadow, of, given = self.__dict__.get("_wb_shadow_held", (None, None, None))
        if of != fp:
            device = engine.device  # type: ignore[union-attr]  # where its buckets land
            shadow = {m.name: torch.empty(m.shape, dtype=m.dtype, device=device) for m in manifest}
        elif given is engine:
            return
        engine.set_destinations(shadow)  # type: ignore[union-attr]
        self._wb_shadow_held = (shadow, fp, engine)

    def pause_generation(self, mode: str = "abort") -> None:
        pass

    def resume_generation(self) -> None:
        pass
