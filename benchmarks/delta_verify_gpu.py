"""Delta mode's whole-destination check (issue 32) on a GPU: ``delta.digests`` over a
model's tensors (one read of each, the Triton kernels' DIGEST rows) next to its floor, one
bulk read of the same bytes (a max over one flat buffer of the model's size), and checked
bitwise against the torch path on a sample. Usage: python benchmarks/delta_verify_gpu.py"""

from __future__ import annotations

import time

import torch

from weightbus.engines import delta as dm
from weightbus.engines.delta import encoding, receiver
from weightbus.planning import presets


def _time(fn, iters: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    print(torch.cuda.get_device_name(), torch.__version__)
    # correctness first: every dtype width, odd sizes, against the torch path
    g = torch.Generator().manual_seed(0)
    sample = [(torch.randn(n, generator=g) * 9).to(dt).cuda() for n in (1, 7, 4097, 1 << 20)
              for dt in (torch.uint8, torch.bfloat16, torch.float32, torch.float64)]
    want = torch.stack([encoding._weighted_range(0, encoding._bits(t.cpu()).long()) for t in sample])
    assert torch.equal(dm.digests(sample), want), "GPU digests differ from the torch path"
    print("digests on the GPU == torch path: OK")
    print("| preset | tensors | GB | digests ms | floor ms (one bulk read) | ratio |")
    print("|---|---|---|---|---|---|")
    for preset, layers in (("8b", None), ("30b-a3b", 24), ("0.6b", None)):
        shapes = presets.shapes(preset, layers)
        total = sum(torch.Size(s).numel() for _, s in shapes)
        flat = torch.empty(total, dtype=torch.bfloat16, device="cuda").normal_()
        views, at = [], 0
        for _, s in shapes:  # (the model's tensors: views of one buffer, as a loaded model's often are not)
            n = torch.Size(s).numel()
            views.append(flat[at:at + n].clone())
            at += n
        targets = receiver._Targets(views)
        ms = _time(lambda t=targets: dm.digests(t))
        floor = _time(lambda f=flat: f.view(torch.int16).amax())  # (a reduction that reads every byte once)
        gb = total * 2 / 1e9
        label = preset + (f"/{layers}L" if layers else "")
        print(f"| {label} | {len(views)} | {gb:.2f} | {ms:.2f} | {floor:.2f} | {ms / floor:.2f}x |")
        del flat, views, targets  # (the next preset needs the room)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
