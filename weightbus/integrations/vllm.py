"""vLLM as a weightbus rollout (``pip install weightbus[vllm]``).

The worker-extension path, which works with every vLLM that has ``worker_extension_cls``
and ``collective_rpc``:

    llm = LLM(model=path, worker_extension_cls="weightbus.integrations.vllm.WeightbusWorkerExtension")
    replica = VLLMReplica(llm, name="vllm0")            # a WorkerGroup the manager drives
    mgr = CheckpointEngineManager("gloo", trainer, [replica])
    mgr.update_weights(version=step)                    # lands in vLLM's own load_weights

Every vLLM worker (one per TP rank) joins the weightbus group as one rollout rank and
feeds the received stream to ``model.load_weights``, which applies vLLM's own name
mapping (fused qkv / gate_up, tied embeddings). Tensors cannot travel as
``collective_rpc`` arguments; only small control values do.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from typing import Any

from weightbus.runtime.group import Pending, WorkerError
from weightbus.worker import EngineHost


class WeightbusWorkerExtension(EngineHost):
    """Mixed into every vLLM worker by ``worker_extension_cls``; reached through
    ``collective_rpc``. ``self.rank`` and ``self.model_runner`` are vLLM's. It adds to
    :class:`EngineHost` only engine set-up on the model's device and receiving into
    vLLM's ``load_weights``; it defines no name vLLM's worker has (``sleep``...), which
    vLLM refuses. The offline engine generates only inside ``llm.generate()``, which the
    caller does not run during an update, so pausing is a no-op."""

    def wb_dispatch(self, method: str, args: Sequence[tuple] | None, kwargs: Sequence[dict] | None) -> Any:
        """Run ``method`` with this rank's share of per-rank arguments."""
        rank = int(getattr(self, "rank", 0))
        a = tuple(args[rank]) if args else ()
        k = dict(kwargs[rank]) if kwargs else {}
        return getattr(self, method)(*a, **k)

    def wb_setup(self, backend: str, role: str, engine_kwargs: dict[str, Any]) -> None:
        kwargs = dict(engine_kwargs)
        if backend in ("nccl", "colocated") and "device" not in kwargs:
            kwargs["device"] = str(next(self.model_runner.model.parameters()).device)  # type: ignore[attr-defined]
        super().wb_setup(backend, "rollout", kwargs)

    def wb_receive(self, version: int) -> dict[str, Any]:
        """Stream one update straight into vLLM's ``load_weights`` (synchronous:
        ``collective_rpc`` runs plain methods)."""
        assert self._wb_engine is not None, "wb_setup first"
        self.weights_version = None  # from the first byte on, the old version is gone
        model = self.model_runner.model  # type: ignore[attr-defined]
        reload = _layerwise_reload()
        stream = self._wb_engine.receive_weights_sync()
        counted = _Counting(stream)
        if reload:  # vLLM rebuilds processed (fused, repacked, quantized) weights in place
            reload[0](model)
        try:
            model.load_weights(counted)
            for _ in counted:  # a model that stops early must still let the update finish
                pass
        finally:
            stream.close()  # type: ignore[attr-defined]
            if reload:  # also after a failure: layers not reloaded get their tensors back
                reload[1](model, self.model_runner.model_config)  # type: ignore[attr-defined]
            _refresh_shared_cpu_kernels(model)
        if self._wb_engine.version != version:
            raise RuntimeError(f"vLLM rank {getattr(self, 'rank', 0)}: received version "
                               f"{self._wb_engine.version}, expected {version}")
        self.weights_version = version
        return {"bytes": counted.bytes, "tensors": counted.tensors}

    def pause_generation(self, mode: str = "abort") -> None:
        pass

    def resume_generation(self) -> None:
        pass


def _layerwise_reload() -> tuple[Any, Any] | None:
    """vLLM's layerwise-reload helpers, where this vLLM has them."""
    try:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )
    except ImportError:
        return None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _refresh_shared_cpu_kernels(model: Any) -> None:
    """On the CPU, vLLM packs each linear weight into a GEMM kernel when it loads. A module
    that only shares another's weight (a tied ``lm_head``) loads nothing itself, so a
    reload leaves its kernel packed from the old weights: pack it again."""
    import torch

    try:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
    except ImportError:
        return
    by_storage: dict[int, list[Any]] = {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and w.device.type == "cpu" and w.ndim == 2 and w.numel():
            by_storage.setdefault(w.data_ptr(), []).append(m)
    for mods in by_storage.values():
        if len(mods) > 1:
            for m in mods:
                if hasattr(m, "cpu_linear"):
                    dispatch_cpu_unquantized_gemm(m, remove_weight=False)


class _Counting:
    def __init__(self, stream: Any):
        self.stream, self.bytes, self.tensors = stream, 0, 0

    def __iter__(self) -> _Counting:
        return self

    def __next__(self) -> tuple[str, Any]:
        name, t = next(self.stream)
        self.bytes += t.numel() * t.element_size()
        self.tensors += 1
        return name, t


class _Future:
    def __init__(self, name: str, method: str, fut: concurrent.futures.Future):
        self.name, self.method, self.fut = name, method, fut

    def result(self, timeout: float) -> list[Any]:
        try:
            return list(self.fut.result(timeout))
        except concurrent.futures.TimeoutError:
            raise WorkerError(self.name, self.method, {0: f"no answer within {timeout:.0f}s"},
                              {0: "timed out"}) from None
        except Exception as e:  # noqa: BLE001 - vLLM re-raises the worker's error
            kind = "died" if "EngineDeadError" in type(e).__name__ else "raised"
            raise WorkerError(self.name, self.method, {0: f"{type(e).__name__}: {e}"}, {0: kind}) from e


class VLLMReplica:
    """An offline ``vllm.LLM`` (built with ``WeightbusWorkerExtension``) as one rollout
    replica of :class:`weightbus.manager.CheckpointEngineManager`; its TP workers are the
    group's ranks. Calls run on a helper thread so the manager can drive the trainer and
    vLLM at once."""

    def __init__(self, llm: Any, name: str = "vllm"):
        self.llm, self.name = llm, name
        self._size = int(llm.llm_engine.vllm_config.parallel_config.world_size)
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"wb-{name}")

    @property
    def size(self) -> int:
        return self._size

    def submit(self, method: str, args: Sequence[tuple] | None = None,
               kwargs: Sequence[dict] | None = None) -> Pending:
        if method in ("sleep", "wake_up"):
            fn = getattr(self.llm, method)
            return _Future(self.name, method, self._pool.submit(lambda: [fn()] * self._size))
        if method == "resume_generation":
            # KV blocks cached for a prompt hold the old weights' keys and values
            return _Future(self.name, method, self._pool.submit(
                lambda: [self.llm.reset_prefix_cache()] * self._size))
        args_l = [tuple(a) for a in args] if args else None
        kwargs_l = [dict(k) for k in kwargs] if kwargs else None
        return _Future(self.name, method, self._pool.submit(
            self.llm.collective_rpc, "wb_dispatch", args=(method, args_l, kwargs_l)))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
