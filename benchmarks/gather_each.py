"""What the hybrid-fsdp ring path's gathers cost (the planner's ``gather_each_eff``): two
FSDP-like ranks on two GPUs all-gather every tensor of a preset one at a time, each into a
new full tensor, the way ``ModuleSource`` gathers a tensor every rank needs when there is
no target to gather into; next to one bulk all-gather of the same bytes (the floor).

    python benchmarks/gather_each.py --preset 8b [--iters 3]

Prints one line per measurement (median ms) and the ratio to the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from weightbus.planning import presets


def _time(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def _worker(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    shapes = presets.shapes(args.preset, args.layers)
    # the trainer's fp32 shards (dim 0 split in two, as FSDP2 does)
    shards = [torch.randn((-(-s[0] // 2), *s[1:]), device="cuda") for _, s in shapes]
    total = sum(t.numel() for t in shards) * 2  # bf16 bytes of one rank's shards

    def each() -> None:
        for t in shards:
            local = t.to(torch.bfloat16)
            full = local.new_empty((2 * local.shape[0], *local.shape[1:]))
            dist.all_gather_into_tensor(full, local)

    chunk = 256 << 20
    src = torch.empty(chunk, dtype=torch.uint8, device="cuda")
    dst = torch.empty(2 * chunk, dtype=torch.uint8, device="cuda")

    def bulk() -> None:
        for _ in range(-(-total // chunk)):
            dist.all_gather_into_tensor(dst, src)

    floor = _time(bulk, args.iters)
    got = _time(each, args.iters)
    if rank == 0:
        print(f"{args.preset}{'/' + str(args.layers) if args.layers else ''}: {len(shards)} tensors, "
              f"{2 * total / 1e9:.2f} GB gathered; per-tensor gathers (cast + gather) {got:.1f} ms, "
              f"bulk all-gather {floor:.1f} ms, ratio {got / floor:.2f}x", flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    mp.spawn(_worker, (args, 29561), nprocs=2)


if __name__ == "__main__":
    main()
