"""``weightbus plan``: the simulator's table for one cluster and layout, the recommended
backend and bucket size, and the update's time against the number of rollout replicas
(a text plot, or an SVG)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from weightbus.cluster import Cluster, Layout, model_shapes
from weightbus.errors import PlanError
from weightbus.simulate import Prediction, manifest_of, plan


@dataclass(frozen=True)
class Question:
    """One planning question: a cluster, a layout, a model and how it travels."""

    cluster: Cluster
    layout: Layout
    model: str
    fp8: bool = False
    delta: float | None = None
    verify_every: int = 1  # delta: the receivers' whole-destination check every this many (0: never)
    trainer_dtype: torch.dtype = torch.bfloat16
    bucket_sizes: tuple[int, ...] = (256 << 20, 1 << 30)


def answer(q: Question) -> tuple[list[Prediction], dict]:
    """The predictions, fastest first, and what the model is (tensors, bytes)."""
    manifest = manifest_of(model_shapes(q.model), fp8=q.fp8)
    preds = plan(q.cluster, q.layout, manifest, bucket_sizes=q.bucket_sizes, fp8=q.fp8, delta=q.delta,
                 verify_every=q.verify_every, trainer_dtype=q.trainer_dtype)
    return preds, {"tensors": len(manifest), "gb": manifest.nbytes / 1e9}


def table(q: Question, preds: list[Prediction], model: dict) -> str:
    c, lay = q.cluster, q.layout
    nic = f"{c.nics_per_node} x {c.nic_gbps:g} GB/s NICs" if c.nics_per_node else "no NIC"
    where = "colocated on the trainers' GPUs" if lay.colocated else "on their own GPUs"
    megatron = f" (Megatron tp {lay.tp} pp {lay.pp} ep {lay.ep})" if lay.megatron else ""
    every = "every update" if q.verify_every == 1 else f"every {q.verify_every} updates"
    check = f"checked whole {every}" if q.verify_every else "never checked whole"
    delta = f", delta updates ({q.delta:g} of the elements changed, {check})" if q.delta else ""
    lines = [
        f"cluster {c.name}: {c.nodes} node(s) x {c.gpus_per_node} GPUs, NVLink {c.nvlink_gbps:g} GB/s, {nic} "
        f"per node, HBM {c.hbm_gbps:g} GB/s",
        f"model {q.model}: {model['tensors']:,} tensors, {model['gb']:.1f} GB on the wire"
        f"{' (fp8 served weights)' if q.fp8 else ''}{delta}",
        f"layout: {lay.trainers} trainer GPUs{megatron} ({lay.n_senders} send) -> {lay.replicas} "
        f"replica(s) x {lay.rollout_gpus} GPU(s), {where}",
        "",
        f"{'backend':<15}{'seconds':>9}{'floor s':>9}{'ratio':>7}{'NIC GB':>9}{'NVLink GB':>10}"
        f"{'GB/rollout':>11}{'+GiB/GPU':>9}{'bucket':>10}{'buckets':>9}  bottleneck",
    ]
    for p in preds:
        lines.append(f"{p.backend:<15}{p.seconds:>9.3f}{p.floor_s:>9.3f}{p.ratio:>6.2f}x{p.nic_gb:>9.1f}"
                     f"{p.nvlink_gb:>10.1f}{p.rollout_gb:>11.1f}{p.peak_extra_gib:>9.2f}"
                     f"{_mib(p):>10}{p.buckets:>9}  "
                     f"{p.bottleneck}")
    best = preds[0]
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in best.parts.items() if v >= 5e-4)
    size = f"{_mib(best)} buckets" if best.buckets else "no buckets (written in place)"
    engine, how = use(best.backend)
    lines += ["", f"recommended: {best.backend}, {size}: {best.seconds:.3f} s, {best.ratio:.2f}x the "
              f"floor ({parts})", f"  use: backend {engine!r}" + (f" {how}" if how else "")]
    lines += [f"  {p.backend}: {'; '.join(p.notes)}" for p in preds if p.notes]
    if best.links:
        lines += ["", f"{best.backend}'s busiest links (GB, seconds at the link's rate):"]
        lines += [f"  {name:<28}{gb:>9.2f} GB{s:>9.3f} s" for name, gb, s in best.links]
    return "\n".join(lines)


#: how each planned schedule is asked for: the engine's name (what ``--backend``,
#: ``CheckpointEngineRegistry`` and the manager take) and what to set on it
USE = {
    "sharded": ("nccl", "with shard destinations on the rollout ranks (a rollout worker's "
                        "weights_placements(), or engine.set_shard_destinations(); vLLM TP replicas "
                        "receive sharded by default)"),
    "colocated": ("colocated", "in direct mode (the rollout exports its tensors: "
                               "engine.set_destinations(named, direct=True))"),
    "colocated-ring": ("colocated", "with its ring of buckets (the default)"),
}


def use(schedule: str) -> tuple[str, str]:
    """``(backend, how)``: the engine a planned schedule runs on, and what to set."""
    return USE.get(schedule, (schedule, ""))


def as_json(q: Question, preds: list[Prediction], model: dict,
            sweep_rows: list[tuple[int, Prediction]] | None = None) -> dict[str, Any]:
    """Everything the table summarises, per backend: what would move per rank (GB each
    sender sends, each rollout GPU receives) and per link (every link's GB), the parts of
    the time, the floor, the memory, the notes; and the sweep, if there is one."""
    lay = q.layout
    return {
        "cluster": asdict(q.cluster),
        "layout": {"trainers": lay.trainers, "senders": lay.n_senders, "replicas": lay.replicas,
                   "rollout_gpus": lay.rollout_gpus, "colocated": lay.colocated, "tp": lay.tp, "pp": lay.pp,
                   "ep": lay.ep, "sender_gpus": [lay.sender_gpu(s) for s in range(lay.n_senders)],
                   "rollout_gpus_by_rank": [lay.rollout_gpu(r) for r in range(lay.rollouts)]},
        "model": {"name": q.model, **model, "fp8": q.fp8, "delta": q.delta, "verify_every": q.verify_every,
                  "trainer_dtype": str(q.trainer_dtype).removeprefix("torch.")},
        "recommended": {"backend": preds[0].backend, "bucket_mb": preds[0].bucket_size >> 20,
                        "use": {"backend": use(preds[0].backend)[0], "how": use(preds[0].backend)[1]}},
        "predictions": [{**asdict(p), "ratio": p.ratio} for p in preds],
        "sweep": [{"replicas": n, "backend": p.backend, "seconds": p.seconds, "floor_s": p.floor_s}
                  for n, p in sweep_rows or []],
    }


def _mib(p: Prediction) -> str:
    return f"{p.bucket_size >> 20} MiB" if p.buckets else "-"


def sweep(q: Question, replicas: list[int]) -> list[tuple[int, Prediction]]:
    """The best backend's prediction for each number of replicas (the cluster grows by
    whole nodes to fit the layout)."""
    out = []
    for n in replicas:
        lay = replace(q.layout, replicas=n)
        need = -(-lay.gpus_needed() // q.cluster.gpus_per_node)
        c = q.cluster.with_nodes(max(q.cluster.nodes, need))
        preds, _ = answer(replace(q, cluster=c, layout=lay))
        out.append((n, preds[0]))
    return out


def sweep_text(rows: list[tuple[int, Prediction]], width: int = 40) -> str:
    top = max(p.seconds for _, p in rows) or 1.0
    lines = [f"{'replicas':>8}  {'best':<10}{'seconds':>9}{'floor s':>9}"]
    for n, p in rows:
        bar = "#" * max(1, round(width * p.seconds / top))
        lines.append(f"{n:>8}  {p.backend:<10}{p.seconds:>9.3f}{p.floor_s:>9.3f}  {bar}")
    return "\n".join(lines)


def sweep_svg(rows: list[tuple[int, Prediction]], title: str) -> str:
    """Seconds (best backend) and the floor against the number of replicas, as an SVG
    line plot (no plotting library needed)."""
    w, h, left, bottom = 560, 300, 60, 40
    xs = [n for n, _ in rows]
    top = max(max(p.seconds, p.floor_s) for _, p in rows) * 1.1 or 1.0

    def at(i: int, v: float) -> tuple[float, float]:
        x = left + (w - left - 20) * (i / max(1, len(xs) - 1))
        return x, h - bottom - (h - bottom - 30) * v / top

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="11">', f'<text x="10" y="18" font-weight="bold">{title}</text>']
    for key, color in (("seconds", "#3070c0"), ("floor_s", "#999999")):
        points = (at(i, getattr(p, key)) for i, (_, p) in enumerate(rows))
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
    for i, (n, p) in enumerate(rows):
        x, y = at(i, p.seconds)
        out.append(f'<text x="{x - 8:.1f}" y="{h - bottom + 15}">{n}</text>')
        out.append(f'<text x="{x + 3:.1f}" y="{y - 4:.1f}">{p.seconds:.2f} s ({p.backend})</text>')
    out += [f'<text x="{w / 2 - 40:.0f}" y="{h - 8}">rollout replicas</text>',
            '<text x="10" y="40" fill="#3070c0">weightbus (best backend)</text>',
            '<text x="10" y="54" fill="#999999">floor</text>', "</svg>"]
    return "\n".join(out)


def check_model(model: str) -> str:
    """``model`` if the planner can read its shapes (a PlanError naming the choices if not)."""
    model_shapes(model)
    return model


__all__ = ["PlanError", "Question", "answer", "as_json", "check_model", "sweep", "sweep_svg", "sweep_text",
           "table"]
