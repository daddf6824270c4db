"""Timing shared by the inference-engine benchmarks (vllm_gpu.py, sglang_gpu.py): a median
of round trips after a warm-up, and the floor every row is compared with, one bulk copy of
the same bytes on one GPU."""

from __future__ import annotations

import statistics
import time


def sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_s(fn, n: int) -> tuple[float, list[float]]:
    """``fn``'s median seconds over ``n`` runs after one warm-up, and every run."""
    fn()  # warm
    runs = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs), runs


def bulk_copy_s(nbytes: int, device, n: int = 5) -> float:
    """One bulk copy of ``nbytes`` on ``device`` (as 1 GiB copies: each at the full rate)."""
    import torch
    chunk = min(nbytes, 1 << 30)
    src = torch.empty(chunk, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    full, rest = divmod(nbytes, chunk)

    def run():
        for _ in range(full):
            dst.copy_(src)
        if rest:
            dst[:rest].copy_(src[:rest])
    med, _ = median_s(run, n)
    src.resize_(0), dst.resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return med
