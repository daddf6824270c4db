"""Rollout variants that fail on purpose, for the manager's failure tests."""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

from rl_workers import Rollout, Trainer  # noqa: E402

from weightbus import ModuleSink  # noqa: E402
from weightbus.sinks import LoadReport  # noqa: E402

#: the elastic backends installed here (their membership changes touch only some peers)
ELASTIC = []
try:
    from mooncake.engine import TransferEngine  # noqa: F401
    ELASTIC.append("mooncake")
except ImportError:
    pass
try:
    import nixl  # noqa: F401
    ELASTIC.append("nixl")
except ImportError:
    pass


class _Trap(ModuleSink):
    def __init__(self, module, action):
        super().__init__(module)
        self.action = action

    def _load_one(self, name, t, report, seen):
        self.action()
        super()._load_one(name, t, report, seen)


class FailingRollout(Rollout):
    """Dies (``die``) or hangs (``hang``) on the first tensor of update ``at``."""

    def __init__(self, rank, world, mode, at):
        super().__init__(rank, world)
        self.mode, self.at, self.version_in_flight = mode, at, None

    async def wb_receive(self, version):
        self.version_in_flight = version
        return await super().wb_receive(version)

    def weights_sink(self):
        def act():
            if self.version_in_flight == self.at:
                if self.mode == "die":
                    os._exit(9)
                time.sleep(3600)
        return _Trap(self.model, act)


class PauseFails(Rollout):
    """``pause_generation`` raises (``raise``), hangs (``hang``) or exits (``die``) at
    update ``at``."""

    def __init__(self, rank, world, mode, at):
        super().__init__(rank, world)
        self.mode, self.at, self.pauses = mode, at, 0

    def pause_generation(self, mode="abort"):
        self.pauses += 1
        if self.pauses == self.at:
            if self.mode == "die":
                os._exit(9)
            if self.mode == "hang":
                time.sleep(3600)
            raise RuntimeError("pause refused (injected)")
        super().pause_generation(mode)


class ResumeFails(Rollout):
    """``resume_generation`` raises at update ``at`` (the weights did arrive)."""

    def __init__(self, rank, world, at):
        super().__init__(rank, world)
        self.at, self.resumes = at, 0

    def resume_generation(self):
        self.resumes += 1
        if self.resumes == self.at:
            raise RuntimeError("resume refused (injected)")
        super().resume_generation()


class _RaiseOn(ModuleSink):
    def __init__(self, module, name):
        super().__init__(module)
        self.name = name

    def _load_one(self, name, t, report, seen):
        if name == self.name:
            raise ValueError(f"cannot load {name} (injected)")
        super()._load_one(name, t, report, seen)


class SinkRaises(Rollout):
    """Its sink raises on one tensor (``name``) at every update."""

    def __init__(self, rank, world, name):
        super().__init__(rank, world)
        self.name = name

    def weights_sink(self):
        return _RaiseOn(self.model, self.name)


class _RaisesMidStream(ModuleSink):
    """A sink of a user's own that reads tensor by tensor, raises partway (at update ``at``)
    and leaves the stream open, as a plain ``async for`` does."""

    def __init__(self, module, at, version):
        super().__init__(module)
        self.at, self.version = at, version

    async def load(self, stream):
        report, seen = LoadReport(), set()
        async for name, t in stream:
            if self.version == self.at and len(seen) == 5:
                raise RuntimeError("sink broke mid-stream (injected)")
            self._load_one(name, t, report, seen)
        return self._close(report, seen, 0)


class SinkRaisesMidStream(Rollout):
    """Its own sink raises partway through update ``at`` without closing the stream."""

    def __init__(self, rank, world, at):
        super().__init__(rank, world)
        self.at, self.receiving = at, None

    async def wb_receive(self, version):
        self.receiving = version
        return await super().wb_receive(version)

    def weights_sink(self):
        return _RaisesMidStream(self.model, self.at, self.receiving)


class SourceRaises(Trainer):
    """``weights_source()`` raises while the trainer sends version ``at``."""

    def __init__(self, rank, world, at):
        super().__init__(rank, world)
        self.at, self.sending = at, None

    async def wb_send(self, version):
        self.sending = version
        return await super().wb_send(version)

    def weights_source(self):
        if self.sending == self.at:
            raise KeyError("optimizer state missing (injected)")
        return super().weights_source()


class SelfRegistering(Rollout):
    """A rollout rank that joins the managers watching ``registry`` by itself (Ray)."""

    def __init__(self, rank, world, replica, registry, dies_at=None):
        super().__init__(rank, world)
        from weightbus.runtime.ray import register_self
        self.replica, self.registry, self.dies_at = replica, registry, dies_at
        register_self(replica, rank, world, registry=registry)

    async def wb_receive(self, version):
        if version == self.dies_at:
            os._exit(9)
        return await super().wb_receive(version)

    def leave(self):
        from weightbus.runtime.ray import unregister_self
        unregister_self(self.replica, self.registry)


class AttachDies(Rollout):
    """Dies when the manager links it to the trainers (an elastic engine's join)."""

    def wb_attach(self, *args, **kwargs):
        os._exit(9)


class Fp8Rollout(Rollout):
    """A rollout that serves its linear weights in fp8 (128x128 blocks, as Qwen3-FP8), the
    rest in bf16: the manager reads that off its sink and the trainers quantize."""

    def __init__(self, rank, world, kind="block"):
        super().__init__(rank, world)
        import torch

        from weightbus.quant import FP8, Fp8Format
        self.state = {}
        for name, t in self.model.state_dict().items():
            if t.dim() == 2 and "emb" not in name:
                fmt = Fp8Format(kind)
                self.state[name] = torch.zeros(t.shape, dtype=FP8)
                self.state[fmt.scale_name(name)] = torch.zeros(fmt.scale_shape(tuple(t.shape)))
            else:
                self.state[name] = t

    def weights_sink(self):
        return ModuleSink(self.state)

    def weights_digest(self):
        from weightbus.tools.demo import digest
        return {n: digest(t) for n, t in self.state.items()}


class Fp8Trainer(Trainer):
    def served_digest(self, kinds):
        """What an fp8 rollout must hold (every rank must call: FSDP2 gathers)."""
        import torch

        from weightbus.quant import Fp8Format
        from weightbus.tools.demo import digest
        out = {}
        for n, t in self.model.state_dict().items():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            kind = kinds.get(n)
            if kind is None:
                out[n] = digest(full.to(torch.bfloat16) if full.is_floating_point() else full)
                continue
            fmt = Fp8Format(kind)
            q, s = fmt.quantize(full.to(torch.bfloat16))
            out[n], out[fmt.scale_name(n)] = digest(q), digest(s)
        return out

    def bf16_bytes(self):
        return sum(t.numel() * 2 for t in self.model.state_dict().values())
