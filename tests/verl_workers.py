"""verl's own workers, configured as a verl user would, for tests/test_verl.py (Ray actors:
importable by module name in every worker process).

- the trainer is verl's ``TrainingWorker`` with its FSDP engine (FSDP2 over gloo on a CPU),
  holding a real Hugging Face model, with verl's checkpoint engine built from the config as
  verl's ``ActorRolloutRefWorker`` builds it (``custom_backend_module`` imported first);
  ``step`` moves its weights between updates, ``digests`` says what it holds;
- each rollout rank is verl's ``CheckpointEngineWorker`` whose server adapter is a
  Hugging Face model (a ``BaseRollout`` that loads what it receives, bitwise);
- a replica is a ``RolloutReplica`` over those workers, with no HTTP server (verl's
  manager only asks servers to pause and resume, which a model with no server need not).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator

import torch
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
from verl.workers.rollout import BaseRollout, RolloutReplica


def digest(named: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's bytes, hashed (bitwise comparison across processes)."""
    out = {}
    for name, t in named.items():
        t = t.detach().contiguous().cpu()
        sha = hashlib.sha1(t.view(torch.uint8).numpy().tobytes()).hexdigest()
        out[name] = f"{t.dtype}:{tuple(t.shape)}:{sha}"
    return out


class Trainer(TrainingWorker):
    """verl's TrainingWorker plus the checkpoint engine verl's actor worker builds."""

    def __init__(self, config: TrainingWorkerConfig, checkpoint_engine_config: CheckpointEngineConfig
                 ) -> None:
        # (verl 0.9.1 asks for "cpu:gloo,<device>:<backend>", which on the CPU platform is
        # "cpu:gloo,cpu:gloo" and torch refuses; it keeps a world group formed before it)
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                                 world_size=int(os.environ["WORLD_SIZE"]))
        super().__init__(config)
        self.use_engine(checkpoint_engine_config)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_engine(self, checkpoint_engine_config: CheckpointEngineConfig) -> None:
        """The checkpoint engine ``checkpoint_engine_config`` names, built as verl's actor
        worker builds it (a test builds its own on workers kept for the module)."""
        backend = checkpoint_engine_config.backend
        import_external_libs(checkpoint_engine_config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, is_master=torch.distributed.get_rank() == 0,
            bucket_size=checkpoint_engine_config.update_weights_bucket_megabytes << 20,
            **checkpoint_engine_config.engine_kwargs.get(backend, {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        # (as verl's ActorRolloutRefWorker.update_weights for a checkpoint-engine backend)
        per_tensor_param, _ = self.engine.get_per_tensor_param()
        metrics = await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps)
        return metrics or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self, step: int) -> None:
        """An optimizer-like change of every weight (different per step and per tensor)."""
        with torch.no_grad():
            for k, p in enumerate(self.engine.module.parameters()):
                local = p.to_local() if hasattr(p, "to_local") else p
                local.add_(torch.full_like(local, 1e-3 * (step + 1) * ((k % 7) - 3)))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def group_token(self) -> str | None:
        """The rendezvous token of the group this rank holds (None: none it may keep)."""
        return (self.checkpoint_engine.engine.formation() or {}).get("token")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def numel(self) -> int:
        """Elements in the whole model (not this rank's shard)."""
        return sum(p.numel() for p in self.engine.module.parameters())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def digests(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
        """What a rollout serving ``dtype`` should hold: the weights verl's engine exports,
        cast as the rollout casts them, hashed."""
        weights, _ = self.engine.get_per_tensor_param()
        return digest({n: t.to(dtype) if t.is_floating_point() else t for n, t in weights})


class ModelRollout(BaseRollout):
    """A rollout that serves a Hugging Face model: loads each received tensor into it."""

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, device_mesh=None):
        super().__init__(config, model_config, device_mesh)
        from transformers import AutoModelForCausalLM
        self.model = AutoModelForCausalLM.from_config(model_config.hf_config, dtype=torch.bfloat16)
        self.params = dict(self.model.state_dict())
        self.received: list[int | None] = []  # the global_steps of each update
        self.refuse: int | None = None  # refuse the update to this step, half way

    async def update_weights(self, weights: AsyncIterator, global_steps: int | None = None, **kwargs):
        seen = set()
        with torch.no_grad():
            async for name, tensor in weights:
                if name not in self.params:
                    raise KeyError(f"the rollout model has no {name!r}")
                if self.refuse == global_steps and len(seen) == len(self.params) // 2:
                    raise RuntimeError(f"the rollout refuses step {global_steps} at {name!r}")
                self.params[name].copy_(tensor)
                seen.add(name)
        missing = set(self.params) - seen
        # (a tied head is one tensor under two names: the update carries it once)
        missing = {n for n in missing if not any(self.params[n] is self.params[s] for s in seen)}
        if missing:
            raise KeyError(f"the update did not carry {sorted(missing)[:3]}")
        self.received.append(global_steps)

    async def resume(self, tags: list[str]):
        pass

    async def release(self):
        pass


class Rollout(CheckpointEngineWorker):
    """verl's CheckpointEngineWorker over a model-serving rollout."""

    def __init__(self, rollout_config: RolloutConfig, model_config: HFModelConfig, *args, **kwargs) -> None:
        adapter = ModelRollout(rollout_config, model_config)
        super().__init__(rollout_config, model_config, adapter, *args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def use_engine(self, rollout_config: RolloutConfig) -> None:
        """The checkpoint engine ``rollout_config`` names, built as verl's
        ``CheckpointEngineWorker.__init__`` builds it, and a server adapter that has received
        nothing yet (a test builds its own on workers kept for the module)."""
        ce = rollout_config.checkpoint_engine
        import_external_libs(ce.custom_backend_module or None)
        self.rollout_config = rollout_config
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            ce.backend, bucket_size=ce.update_weights_bucket_megabytes << 20,
            **ce.engine_kwargs.get(ce.backend, {}))
        self.server_adapter.received, self.server_adapter.refuse = [], None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def digests(self) -> dict[str, str]:
        return digest(self.server_adapter.params)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def refuse(self, step: int) -> None:
        self.server_adapter.refuse = step

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def steps_received(self) -> list[int | None]:
        return list(self.server_adapter.received)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def engine_version(self) -> int | None:
        return self.checkpoint_engine.version

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def group_token(self) -> str | None:
        return (self.checkpoint_engine.engine.formation() or {}).get("token")


class Replica(RolloutReplica):
    """A rollout replica over ``Rollout`` workers (no server to launch)."""

    async def launch_servers(self):
        pass
