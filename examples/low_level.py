"""The low-level API, one process per rank: trainer ranks send, rollout ranks receive.

    torchrun --nproc-per-node 2 examples/low_level.py                 # 1 trainer -> 1 rollout
    torchrun --nproc-per-node 4 examples/low_level.py --trainers 2    # 2 trainers -> 2 rollouts
    python examples/low_level.py [--trainers T --rollouts R]          # the same, no torchrun

Each trainer rank holds the same policy (replicas, like DDP) and takes a real optimizer
step before every update; every rank then checks that all ranks hold the same bf16 bits.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import subprocess
import sys

import torch

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource
from weightbus.runtime.local import join


def policy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


def bits(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def rank_main(args: argparse.Namespace) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    T = args.trainers
    R = world - T
    trainer = rank < T
    engine = CheckpointEngineRegistry.new(args.backend, role="trainer" if trainer else "rollout",
                                          bucket_size=1 << 20, timeout=60)
    # one call per rank: rank 0 serves the rendezvous (torchrun's own store under torchrun)
    rdv = join(engine, rank=rank, trainer_world_size=T, rollout_world_size=R,
               master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]))
    model = policy() if trainer else policy().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2) if trainer else None
    for step in range(1, args.steps + 1):
        if trainer:
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            opt.zero_grad()  # type: ignore[union-attr]
            loss.backward()
            opt.step()  # type: ignore[union-attr]
            stats = asyncio.run(engine.send_weights(ModuleSource(model, dtype=torch.bfloat16), version=step))
            what = f"sent {stats.bytes / 1e6:.2f} MB in {stats.seconds * 1e3:.1f} ms"
        else:
            report = asyncio.run(ModuleSink(model).load(engine.receive_weights()))
            what = f"loaded {report.loaded} tensors ({report.bytes / 1e6:.2f} MB)"
        held = rdv.all_gather(bits(model))
        assert len(set(held)) == 1, f"rank {rank}: version {step} differs across ranks: {held}"
        line = (f"rank {rank} ({'trainer' if trainer else 'rollout'}): version {engine.version}: {what}; "
                f"every rank holds {held[0]}\n")
        sys.stdout.write(line)  # one write per line: the ranks share the terminal
        sys.stdout.flush()
    engine.finalize(destroy_group=True)


def launch(args: argparse.Namespace) -> int:
    """Without torchrun: start the ranks as local processes, torchrun's way (env vars)."""
    from weightbus.comm import free_port

    world = args.trainers + args.rollouts
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": str(world), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env={**env, "RANK": str(r)})
             for r in range(world)]
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return max(codes)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trainers", type=int, default=1, help="trainer ranks (default 1)")
    p.add_argument("--rollouts", type=int, default=1, help="rollout ranks without torchrun (default 1)")
    p.add_argument("--backend", default="gloo", help="gloo (default), colocated, nccl...")
    p.add_argument("--steps", type=int, default=3, help="updates (default 3)")
    a = p.parse_args()
    sys.exit(rank_main(a) or 0 if "RANK" in os.environ else launch(a))
