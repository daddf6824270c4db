"""Trainer-side fp8 quantization (weightbus.quant) against its floor, on a preset's shapes.

    python benchmarks/quant_fp8.py --preset 30b-a3b [--layers N] [--kind block] [--device cuda]

The served weights are a Qwen3 FP8 checkpoint's: every linear weight (attention,
experts, dense MLP) in fp8; the embeddings, the head, the norms and the MoE router stay
in bf16. The floor is one bulk cast of all their bytes, bf16 -> e4m3 (one kernel, the
same bytes read and written); the row prints our time (``quantize_many``, as
``QuantizedSource`` runs it at every update: on a GPU, block formats in one Triton launch),
the floor's, the ratio, the bandwidth both reach (bf16 read + fp8 written + scales), and
the plain path's time (torch ops a tensor at a time: what runs on a CPU), and the time to
iterate ``QuantizedSource`` over a module's weights (what an update runs: its 1 GiB
groups, the NaN check, the yields) next to iterating the bare source, and the time of its
``plain_tensors`` (what an engine reads of a source that holds its tensors: all of them
quantized in bulk, one replayed launch).
"""

from __future__ import annotations

import argparse
import time

import torch

from weightbus.planning import presets
from weightbus.planning.simulate import served_fp8 as served
from weightbus.quant import FP8, Fp8Format, QuantizedSource, quantize_many
from weightbus.sources import ModuleSource


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(preset: str, layers: int | None, kind: str, device: torch.device, iters: int,
        plain_too: bool = True, each: bool = False) -> dict:
    shapes = [(n, s) for n, s in presets.shapes(preset, layers) if served(n, s)]
    numel = [s[0] * s[1] for _, s in shapes]
    flat = torch.randn(sum(numel), device=device, dtype=torch.bfloat16)
    weights = list(flat.split(numel))
    weights = [w.view(s) for w, (_, s) in zip(weights, shapes, strict=True)]
    fmt = Fp8Format(kind)
    outs = [torch.empty(s, dtype=FP8, device=device) for _, s in shapes]
    scales = [torch.empty(fmt.scale_shape(s), dtype=torch.float32, device=device) for _, s in shapes]
    cast = torch.empty(flat.shape, dtype=FP8, device=device)

    def timed(fn, name: str = "") -> float:
        fn()
        _sync(device)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            _sync(device)
            times.append(time.perf_counter() - t0)
        if each and name:
            print(f"  {name}, each iteration ms: " + " ".join(f"{t * 1e3:.1f}" for t in times))
        return min(times)

    def plain() -> None:  # a tensor at a time, torch ops (the CPU path)
        for w, o, s in zip(weights, outs, scales, strict=True):
            fmt.quantize(w, o, s)

    items = [(fmt, w) for w in weights]
    cache: dict = {}  # (what QuantizedSource keeps across updates)
    floor = timed(lambda: cast.copy_(flat), "floor")
    ours_s = timed(lambda: quantize_many(items, cache), "quantize_many")
    if each and device.type == "cuda":  # where one more call's time goes: its kernels' share
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            quantize_many(items, cache)
            _sync(device)
        kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
        print("  one more call, GPU time by kernel: " + "; ".join(
            f"{e.key[:40]} x{e.count} {e.device_time_total / 1e3:.1f} ms" for e in
            sorted(kernels, key=lambda e: -e.device_time_total)[:4]))
    plain_s = timed(plain) if plain_too else float("nan")
    # what runs at an update: QuantizedSource over a module's weights, iterated to the end
    # (its groups, the NaN check, the yields), against iterating the bare source
    named = {n: w for (n, _), w in zip(shapes, weights, strict=True)}
    bare = ModuleSource(named, dtype=torch.bfloat16)
    wrapped = QuantizedSource(bare, {n: fmt for n in named})
    bare_s = timed(lambda: sum(1 for _ in bare))
    source_s = timed(lambda: sum(1 for _ in wrapped))
    bulk_s = timed(lambda: wrapped.plain_tensors())  # (an engine's read of a source that holds them)
    moved = flat.numel() * 3 + sum(s.numel() * 4 for s in scales)
    return {"preset": preset, "layers": layers, "kind": kind, "tensors": len(shapes),
            "gb_bf16": flat.numel() * 2 / 1e9, "ours_s": ours_s, "plain_s": plain_s,
            "source_s": source_s, "bulk_s": bulk_s, "bare_s": bare_s, "floor_s": floor,
            "ours_gbps": moved / ours_s / 1e9, "floor_gbps": moved / floor / 1e9}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", action="append")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--kind", action="append", choices=["block", "channel", "tensor"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--each", action="store_true", help="print every iteration's time, and profile one call")
    a = p.parse_args()
    device = torch.device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}; torch {torch.__version__}")
    print(f"{'preset':<14} {'layers':>6} {'kind':<7} {'tensors':>7} {'GB bf16':>8} {'ours ms':>9} "
          f"{'floor ms':>9} {'ratio':>7} {'ours GB/s':>10} {'floor GB/s':>10} {'plain ms':>9} "
          f"{'source ms':>9} {'bulk ms':>8} {'bare ms':>8}")
    for preset in a.preset or ["30b-a3b"]:
        for kind in a.kind or ["block"]:
            r = run(preset, a.layers, kind, device, a.iters, each=a.each)
            print(f"{r['preset']:<14} {str(r['layers'] or 'all'):>6} {r['kind']:<7} {r['tensors']:>7} "
                  f"{r['gb_bf16']:>8.2f} {r['ours_s'] * 1e3:>9.1f} {r['floor_s'] * 1e3:>9.1f} "
                  f"{r['ours_s'] / r['floor_s']:>6.2f}x {r['ours_gbps']:>10.0f} {r['floor_gbps']:>10.0f} "
                  f"{r['plain_s'] * 1e3:>9.1f} {r['source_s'] * 1e3:>9.1f} {r['bulk_s'] * 1e3:>8.1f} "
                  f"{r['bare_s'] * 1e3:>8.1f}")
            del r
            if device.type == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
