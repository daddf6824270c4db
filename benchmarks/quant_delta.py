"""Deltas in serving precision: a bf16 trainer, an fp8 rollout, delta updates of the fp8
payloads (``QuantizedSource`` under ``delta=True``), against the dense fp8 bytes.

    python benchmarks/quant_delta.py [--preset 0.6b --layers 4] [--change 0.02] [--updates 4]
                                     [--served-only]

One trainer and one rollout process over gloo. Before every update a ``--change`` share of
each weight's bf16 elements moves by one bf16 step (what RL learning rates do to bf16
weights); the rollout holds the served weights in fp8 (128x128 blocks, as Qwen3-FP8) and
the rest in bf16. Printed per update: the share of fp8 elements and of 128x128 blocks that
changed, the scales that changed, and the bytes on the wire against the dense update's
(fp8 payloads + scales + the bf16 rest). Every update is checked bitwise on the rollout.
"""

from __future__ import annotations

import argparse
import asyncio

import torch

from weightbus import CheckpointEngineRegistry, ModuleSink, ModuleSource
from weightbus.planning.simulate import served_fp8 as served
from weightbus.quant import FP8, Fp8Format, QuantizedSource
from weightbus.runtime.local import Rendezvous, connect
from weightbus.tools.demo import digest


def nudge(weights: dict[str, torch.Tensor], share: float, seed: int) -> None:
    """Move ``share`` of every tensor's bf16 elements by one bf16 step (up or down)."""
    g = torch.Generator().manual_seed(seed)
    for t in weights.values():
        bits = t.view(torch.int16).view(-1)
        magnitude = bits & 0x7FFF  # (a step of the bits is one of the value's magnitude:
        mask = (torch.rand(bits.shape, generator=g) < share) & (magnitude > 1) & (magnitude < 0x7F7F)
        # zero, the smallest and the largest magnitudes are left alone: no sign flip, no inf)
        step = torch.where(torch.rand(bits.shape, generator=g) < 0.5, -1, 1).to(torch.int16)
        bits.add_(step * mask)


def fp8_deltas(rank: int, port: int, shapes: list[tuple[str, tuple[int, ...]]], updates: int,
               share: float) -> list[dict]:
    """Rank 0 trains (bf16) and sends fp8 deltas; rank 1 holds the fp8 model and checks."""
    torch.set_num_threads(1)
    rdv = Rendezvous("127.0.0.1", port, rank, 2, timeout=60)
    engine = CheckpointEngineRegistry.new("gloo", role="trainer" if rank == 0 else "rollout", delta=True,
                                          bucket_size=1 << 22, timeout=120)
    formats = {n: Fp8Format("block") for n, s in shapes if served(n, s)}
    torch.manual_seed(0)
    weights = {n: (torch.randn(s) * 0.02).to(torch.bfloat16) for n, s in shapes}
    held: dict[str, torch.Tensor] = {}
    if rank == 1:  # what an fp8 rollout holds
        for n, s in shapes:
            fmt = formats.get(n)
            held[n] = torch.zeros(s, dtype=FP8 if fmt else torch.bfloat16)
            if fmt:
                held[fmt.scale_name(n)] = torch.zeros(fmt.scale_shape(s), dtype=torch.float32)
        engine.set_destinations(held)
    connect(engine, rdv, 1, 1)
    source = QuantizedSource(ModuleSource(weights), formats) if rank == 0 else None
    log, last = [], None
    for k in range(updates + 1):
        if k:
            nudge(weights, share, k)
        if rank == 0:
            stats = asyncio.run(engine.send_weights(source, version=k + 1))
            now = dict(source)
            now = {n: t.clone() for n, t in now.items()}  # (the payloads are rewritten next update)
            row = {"wire": stats.wire_bytes, "dense": source.manifest.nbytes, "delta": stats.delta,
                   "expected": {n: digest(t) for n, t in now.items()}}
            if last is not None:
                row.update(_changes(formats, last, now))
            last = now
        else:
            report = asyncio.run(ModuleSink(held).load(engine.receive_weights()))
            assert report.ok, report.describe()
            row = {"got": {n: digest(t) for n, t in held.items()}, "version": engine.version}
        log.append(row)
    engine.finalize(destroy_group=True)
    return log


def _changes(formats: dict[str, Fp8Format], before: dict[str, torch.Tensor],
             after: dict[str, torch.Tensor]) -> dict[str, float]:
    elements = changed = blocks = blocks_changed = scales = scales_changed = 0
    for name, fmt in formats.items():
        a, b = before[name].view(torch.uint8), after[name].view(torch.uint8)
        diff = a != b
        elements += diff.numel()
        changed += int(diff.sum())
        bm, bn = fmt.block
        rows, cols = diff.shape
        padded = torch.zeros(-(-rows // bm) * bm, -(-cols // bn) * bn, dtype=torch.bool)
        padded[:rows, :cols] = diff
        per_block = padded.view(padded.shape[0] // bm, bm, padded.shape[1] // bn, bn).any(3).any(1)
        s_diff = before[fmt.scale_name(name)] != after[fmt.scale_name(name)]
        blocks += per_block.numel()
        blocks_changed += int((per_block | s_diff).sum())
        scales += s_diff.numel()
        scales_changed += int(s_diff.sum())
    return {"fp8_elements": changed / elements, "fp8_blocks": blocks_changed / blocks,
            "scales": scales_changed / scales}


def main() -> None:
    import torch.distributed as dist

    from weightbus.planning import presets
    from weightbus.runtime.local import spawn
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="0.6b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--change", type=float, default=0.02)
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--served-only", action="store_true",
                   help="send only the fp8 weights (no bf16 embeddings, head, norms)")
    a = p.parse_args()
    shapes = presets.shapes(a.preset, a.layers)
    if a.served_only:
        shapes = [(n, s) for n, s in shapes if served(n, s)]
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # (the workers meet here)
    logs = spawn(fp8_deltas, 2, (store.port, shapes, a.updates, a.change), timeout=1800)
    sent, got = logs
    assert all(s["expected"] == g["got"] for s, g in zip(sent, got, strict=True)), "not bitwise"
    print(f"{a.preset}, {a.layers} layers, {len(shapes)} tensors; bf16 change per update {a.change:.1%}; "
          f"dense fp8 update {sent[0]['dense'] / 1e6:.1f} MB (bitwise on the rollout: yes)")
    print(f"{'update':>6} {'delta':>5} {'fp8 elements':>12} {'fp8 blocks':>10} {'scales':>7} "
          f"{'wire MB':>8} {'÷ dense fp8':>11}")
    for k, s in enumerate(sent[1:], start=2):
        print(f"{k:>6} {str(s['delta']):>5} {s['fp8_elements']:>12.2%} {s['fp8_blocks']:>10.1%} "
              f"{s['scales']:>7.1%} {s['wire'] / 1e6:>8.2f} {s['wire'] / s['dense']:>10.1%}")


if __name__ == "__main__":
    main()
