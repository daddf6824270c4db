"""Host-side costs of one update's control work on this machine (no GPU work timed): a
gloo broadcast and all-reduce of a header between two processes, and a pointer pass over
a model's worth of CUDA tensors. Usage: python benchmarks/host_costs.py [n_tensors]"""

import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _collectives(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.zeros(8, dtype=torch.int64)
    for name, f in [("broadcast", lambda: dist.broadcast(t, 0)),
                    ("all-reduce", lambda: dist.all_reduce(t, dist.ReduceOp.MAX))] * 2:
        for _ in range(20):
            f()
        dist.barrier()
        s = time.perf_counter()
        for _ in range(300):
            f()
        if rank == 0:
            print(f"gloo {name} of 8 int64, 2 processes: {(time.perf_counter() - s) / 300 * 1e6:.0f} us")
    dist.destroy_process_group()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 9435
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ts = {f"t{i}": torch.empty(64, device=device) for i in range(n)}

    def timed(f, reps=50):
        f()
        s = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - s) / reps * 1e3
    listed = timed(lambda: [t.data_ptr() for t in ts.values()])
    mapped = timed(lambda: np.fromiter(map(torch.Tensor.data_ptr, ts.values()), np.int64, n))
    print(f"{n} {device} tensors: list of data_ptr {listed:.2f} ms; np.fromiter(map) {mapped:.2f} ms")
    mp.spawn(_collectives, args=(29611,), nprocs=2)


if __name__ == "__main__":
    main()
