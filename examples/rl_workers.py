"""Trainer and rollout workers for the examples (and the tests that run them).

They are ordinary user classes: each mixes in ``WeightbusWorker`` and says where its
weights come from (``weights_source``) or go (``weights_sink``). The "rollout" is a small
HF-style decoder generating greedily on the CPU; the trainer trains the same model.
"""

from __future__ import annotations

import hashlib
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from weightbus import ModuleSink, ModuleSource
from weightbus.tools.demo import TinyTransformer, digest
from weightbus.worker import WeightbusWorker

SIZE = {"vocab": 512, "dim": 64, "layers": 2}


def model_digest(model: torch.nn.Module) -> str:
    """One fingerprint of every tensor's bits (bf16 as the rollout holds them)."""
    h = hashlib.sha256()
    for n, t in model.state_dict().items():
        h.update(f"{n}={digest(t.to(torch.bfloat16) if t.is_floating_point() else t)};".encode())
    return h.hexdigest()[:24]


class Trainer(WeightbusWorker):
    """A trainer rank: FSDP2 over gloo when there are several ranks."""

    def __init__(self, rank: int, world: int, port: int | None = None):
        torch.set_num_threads(1)
        self.rank = rank
        torch.manual_seed(0)
        self.model = TinyTransformer(SIZE["vocab"], SIZE["dim"], SIZE["layers"])
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world)
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            fully_shard(self.model, mesh=init_device_mesh("cpu", (world,)))  # CPU even with CUDA
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train_step(self, step: int, seconds: float = 0.0) -> float:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, SIZE["vocab"], (4, 32), generator=g)
        logits = self.model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, SIZE["vocab"]), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        with torch.no_grad():
            self.model.steps += 1
        time.sleep(seconds)  # stands in for a longer step, so overlap is visible
        return float(loss.detach())

    def weights_source(self) -> ModuleSource:
        return ModuleSource(self.model, dtype=torch.bfloat16)

    def weights_digest(self) -> str:
        """The digest a rollout holding these weights must show (every rank must call)."""
        full = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t)
                for n, t in self.model.state_dict().items()}
        h = hashlib.sha256()
        for n, t in full.items():
            h.update(f"{n}={digest(t.to(torch.bfloat16) if t.is_floating_point() else t)};".encode())
        return h.hexdigest()[:24]


class Rollout(WeightbusWorker):
    """A rollout rank: greedy generation, pause/resume, sleep/wake, and a background
    generation loop for fully-async training. Samples carry the weight version."""

    def __init__(self, rank: int, world: int):
        torch.set_num_threads(1)
        self.rank = rank
        torch.manual_seed(1)  # different from the trainer: only an update makes them equal
        self.model = TinyTransformer(SIZE["vocab"], SIZE["dim"], SIZE["layers"]).to(torch.bfloat16)
        self.model.eval()
        self._gate = threading.Condition()
        self._paused = False
        self._abort = False
        self._parked = True
        self._loop: threading.Thread | None = None
        self._stop = False
        self.samples: list[dict[str, Any]] = []
        self.aborted = 0
        self.asleep = False

    def weights_sink(self) -> ModuleSink:
        return ModuleSink(self.model)

    def weights_digest(self) -> str:
        return model_digest(self.model)

    @torch.no_grad()
    def _generate_one(self, prompt: list[int], steps: int) -> list[int] | None:
        tokens = torch.tensor([prompt])
        for _ in range(steps):
            if self._abort:
                return None
            nxt = self.model(tokens)[0, -1].float().argmax()
            tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
        return tokens[0, len(prompt):].tolist()

    def generate(self, prompts: list[list[int]], steps: int = 8) -> list[dict[str, Any]]:
        """Synchronous generation (one-step-off): each sample tagged with its version."""
        if self.asleep:
            raise RuntimeError("rollout is asleep")
        v = self.weights_version
        return [{"tokens": self._generate_one(p, steps), "version": v, "digest": model_digest(self.model)}
                for p in prompts]

    # --- fully async ---------------------------------------------------------------------------
    def start_loop(self, steps: int = 6) -> None:
        """Generate continuously in a background thread until stop_loop()."""
        def run() -> None:
            k = 0
            while not self._stop:
                with self._gate:
                    self._parked = self._paused
                    self._gate.notify_all()
                    while self._paused and not self._stop:
                        self._gate.wait(0.1)
                    self._parked = False
                v, d0 = self.weights_version, model_digest(self.model)
                out = self._generate_one([k % SIZE["vocab"], 7, 11], steps)
                if out is None:  # aborted mid-request by an update: never mixes versions
                    self.aborted += 1
                else:
                    self.samples.append({"tokens": out, "version": v, "digest": d0,
                                         "digest_end": model_digest(self.model)})
                k += 1
        self._stop = False
        self._loop = threading.Thread(target=run, daemon=True)
        self._loop.start()

    def stop_loop(self) -> list[dict[str, Any]]:
        self._stop = True
        if self._loop is not None:
            self._loop.join(30)
        return self.samples

    def pause_generation(self, mode: str = "abort") -> None:
        with self._gate:
            self._paused = True
            self._abort = mode == "abort"
            deadline = time.monotonic() + 30
            while self._loop is not None and self._loop.is_alive() and not self._parked:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rollout rank {self.rank}: generation did not pause in 30 s")
                self._gate.wait(0.05)

    def resume_generation(self) -> None:
        with self._gate:
            self._paused = False
            self._abort = False
            self._gate.notify_all()

    def is_paused(self) -> bool:
        return self._paused

    # --- hybrid: release and restore memory ---------------------------------------------------
    def sleep(self) -> None:
        """Free the weights' memory while the trainer trains (shapes are kept)."""
        live = self.model.state_dict(keep_vars=True)  # the Parameters themselves
        self._shapes = {n: (t.shape, t.dtype) for n, t in live.items()}
        for t in live.values():
            t.data = torch.empty(0, dtype=t.dtype)
        self.asleep = True
        self.weights_version = None

    def wake_up(self) -> None:
        """Allocate the weights again (contents arrive with the next update)."""
        if not self.asleep:
            return
        for n, t in self.model.state_dict(keep_vars=True).items():
            shape, dtype = self._shapes[n]
            t.data = torch.zeros(shape, dtype=dtype)
        self.asleep = False

    def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
