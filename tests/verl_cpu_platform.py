"""A CPU platform for verl 0.9.1, through its platform plugin hook (``PlatformRegistry``,
loaded by ``VERL_USE_EXTERNAL_MODULES`` and chosen by ``VERL_PLATFORM=cpu``).

verl 0.9.1 ships CUDA, NPU and ROCm platforms only; on a machine with none it falls back to
CUDA, and its workers then ask for an NCCL process group and ``cuda`` devices. This module
describes the host instead (device ``cpu``, collectives over gloo), which is what lets
verl's own ``TrainingWorker`` (FSDP2) and ``CheckpointEngineWorker`` run in CI.
"""

from __future__ import annotations

import contextlib
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _noop(*args, **kwargs):
    return None


# (what verl calls on ``get_torch_device()``: the torch.cuda-like module of the platform)
_cpu_module = types.SimpleNamespace(
    is_available=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1,
    set_device=_noop, synchronize=_noop, empty_cache=_noop, manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed, memory_allocated=lambda *a, **k: 0,
    memory_reserved=lambda *a, **k: 0, max_memory_allocated=lambda *a, **k: 0,
    max_memory_reserved=lambda *a, **k: 0, reset_peak_memory_stats=_noop,
    mem_get_info=lambda *a, **k: (0, 0), get_device_name=lambda *a, **k: "cpu",
    Stream=torch.cpu.Stream, stream=torch.cpu.stream, current_stream=torch.cpu.current_stream,
    is_initialized=lambda: True, ipc_collect=_noop,
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """The host as verl's device: tensors on ``cpu``, collectives over gloo."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.SimpleNamespace:
        return _cpu_module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return True

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "WEIGHTBUS_VISIBLE_CPUS"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None
