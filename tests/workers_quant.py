"""Worker bodies for the fp8-on-the-wire tests (importable by spawned processes)."""

from __future__ import annotations

import asyncio

import torch
from torch import nn
from workers import new_engine

from weightbus import ModuleSink, ModuleSource
from weightbus.quant import FP8, Fp8Format, QuantizedSource, module_formats
from weightbus.runtime.local import Rendezvous, connect
from weightbus.tools.demo import digest


class Trainer(nn.Module):
    """bf16 (or fp32) weights of ragged shapes: blocks cut at the edges, a row of zeros."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(300, 136, dtype=dtype)  # not quantized: served in bf16
        self.q = nn.Linear(136, 264, bias=False, dtype=dtype)  # 3x2 blocks, ragged both ways
        self.up = nn.Linear(136, 40, bias=True, dtype=dtype)   # one ragged block; bias as is
        self.down = nn.Linear(40, 136, bias=False, dtype=dtype)
        with torch.no_grad():
            self.q.weight[5].zero_()  # an all-zero row (and part of a block)

    def step(self, k: int) -> None:
        g = torch.Generator().manual_seed(k)
        with torch.no_grad():
            for p in self.parameters():
                mask = torch.rand(p.shape, generator=g) < 0.3  # some blocks keep their scale
                p.add_((torch.randn(p.shape, generator=g).to(p.dtype) * 0.02 * mask).to(p.device))
            self.q.weight[5].zero_()


def rollout_state(formats: dict[str, Fp8Format]) -> dict[str, torch.Tensor]:
    """What an fp8 rollout model holds: fp8 weights with their scales, the rest in bf16."""
    shapes = {"embed.weight": (300, 136), "q.weight": (264, 136), "up.weight": (40, 136),
              "up.bias": (40,), "down.weight": (136, 40)}
    state: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        fmt = formats.get(name)
        if fmt is None:
            state[name] = torch.zeros(shape, dtype=torch.bfloat16)
            continue
        state[name] = torch.zeros(shape, dtype=FP8)
        state[fmt.scale_name(name)] = torch.zeros(fmt.scale_shape(shape), dtype=torch.float32)
    return state


SERVED = {"q.weight": Fp8Format("block"), "up.weight": Fp8Format("channel"),
          "down.weight": Fp8Format("tensor")}


SERVED_BLOCK = {n: Fp8Format("block") for n in SERVED}


def fp8_updates(rank: int, backend: str, T: int, R: int, port: int, trainer_dtype: str, gpu: bool = False):
    """The rollout declares its formats (read off its model); the trainers quantize on the
    way; every update lands bitwise as the quantizer makes it, in half the bytes. ``gpu``:
    the trainer's model on the GPU, every weight served in blocks, one source built once
    (its tensors quantized in bulk: ``plain_tensors``, replayed from the second update)."""
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, T + R, timeout=60)
    engine = new_engine(backend, rank >= T, bucket_size=1 << 14, timeout=30)
    connect(engine, rdv, T, R)
    state = rollout_state(SERVED_BLOCK if gpu else SERVED) if rank >= T else None
    declared = rdv.all_gather(module_formats(state) if rank == T else None)[T]  # the rollout says
    model = Trainer(getattr(torch, trainer_dtype))
    if gpu and rank < T:
        model = model.cuda()
        once = QuantizedSource(ModuleSource(model, dtype=torch.bfloat16), declared)
    out = []
    for k in (1, 2, 3):
        model.step(k)
        if rank < T:
            source = once if gpu else QuantizedSource(ModuleSource(model, dtype=torch.bfloat16), declared)
            result = asyncio.run(engine.send_weights(source, version=k))
            expected = {}
            for name, t in model.state_dict().items():
                fmt = declared.get(name)
                if fmt is None:
                    expected[name] = digest(t.to(torch.bfloat16))
                else:
                    q, scale = fmt.quantize(t.to(torch.bfloat16))  # (the source's dtype policy first)
                    expected[name], expected[fmt.scale_name(name)] = digest(q), digest(scale)
            served = sum(t.numel() * 2 for n, t in model.state_dict().items() if n in declared)
            as_is = sum(t.numel() * 2 for n, t in model.state_dict().items() if n not in declared)
            # the declared weights' share of the wire, against their bf16 bytes
            out.append({"expected": expected, "fp8_bytes": result.bytes - as_is, "bf16_bytes": served,
                        "bulk": id(source._last[2]) if source._last is not None else None})
        else:
            report = asyncio.run(ModuleSink(state).load(engine.receive_weights()))
            assert report.ok, report.describe()
            out.append({"got": {n: digest(t) for n, t in state.items()}, "version": engine.version})
    engine.finalize(destroy_group=True)
    return out


def fp8_direct(rank: int, port: int):
    """Colocated direct mode on one GPU into an fp8 rollout: the trainer's source writes
    straight into the rollout's exported tensors (the block weights quantized by the kernel
    into them), bitwise as the plain quantizer makes them, over updates of changing
    weights; a NaN fails the update on both ranks naming the weight; the next one lands."""
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=120)
    engine = new_engine("colocated", rank == 1, device=device, timeout=60)
    state = None
    if rank == 1:
        state = {n: t.to(device) for n, t in rollout_state(SERVED).items()}
        engine.set_destinations(state)
    connect(engine, rdv, 1, 1)
    assert engine._direct
    model = Trainer(torch.bfloat16).to(device)
    source = QuantizedSource(ModuleSource(model, dtype=torch.bfloat16), SERVED)
    out = []
    for k in (1, 2, 3, 4, 5):
        model.step(k)
        if k == 4:
            with torch.no_grad():
                model.q.weight[200, 7] = float("nan")
        rdv.all_gather(None)
        try:
            if rank == 0:
                asyncio.run(engine.send_weights(source, version=k))
                expected = {}
                for name, t in model.state_dict().items():
                    fmt = SERVED.get(name)
                    if fmt is None:
                        expected[name] = digest(t.cpu())
                    else:
                        q, scale = fmt.quantize(t)
                        expected[name], expected[fmt.scale_name(name)] = digest(q.cpu()), digest(scale.cpu())
                out.append({"expected": expected, "fused": source._last is None})  # (no fp8 copy made)
            else:
                report = asyncio.run(ModuleSink(state).load(engine.receive_weights()))
                assert report.ok, report.describe()
                out.append({"got": {n: digest(t.cpu()) for n, t in state.items()}, "version": engine.version})
        except Exception as e:  # noqa: BLE001
            out.append({"error": str(e)})
        if k == 4:
            with torch.no_grad():
                model.q.weight[200, 7] = 0.5
    engine.finalize(destroy_group=True)
    return out
