"""``weightbus plan``: the simulator's table for one cluster and layout, the recommended
backend and bucket size, and the update's time against the number of rollout replicas
(a text plot, or an SVG)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from weightbus.errors import PlanError
from weightbus.planning.cluster import Cluster, Layout, model_shapes
from weightbus.planning.simulate import Prediction, manifest_of, plan


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
    "sharded-relay": ("nccl", "with shard destinations on the rollout ranks and relay=k on every "
                              "engine (k: its note; each replica's ranks forward their shards to the next)"),
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
    return [(n, preds[0]) for n, preds in sweep_all(q, replicas)]


def sweep_all(q: Question, replicas: list[int]) -> list[tuple[int, list[Prediction]]]:
    """Every backend's prediction (best first) for each number of replicas."""
    out = []
    for n in replicas:
        lay = replace(q.layout, replicas=n)
        need = -(-lay.gpus_needed() // q.cluster.gpus_per_node)
        c = q.cluster.with_nodes(max(q.cluster.nodes, need))
        preds, _ = answer(replace(q, cluster=c, layout=lay))
        out.append((n, preds))
    return out


def sweep_text(rows: list[tuple[int, Prediction]], width: int = 40) -> str:
    top = max(p.seconds for _, p in rows) or 1.0
    lines = [f"{'replicas':>8}  {'best':<10}{'seconds':>9}{'floor s':>9}"]
    for n, p in rows:
        bar = "#" * max(1, round(width * p.seconds / top))
        lines.append(f"{n:>8}  {p.backend:<10}{p.seconds:>9.3f}{p.floor_s:>9.3f}  {bar}")
    return "\n".join(lines)


_COLORS = ("#3070c0", "#d06020", "#30a050", "#a040a0", "#c0a020", "#20a0b0")


def sweep_svg(rows: list[tuple[int, list[Prediction]]], title: str) -> str:
    """Seconds per update of every backend, and the floor, against the number of replicas
    (``sweep_all``'s rows), as an SVG line plot (:func:`lines_svg`: the replica counts at
    their true places on a log axis, seconds on a labelled linear axis)."""
    backends = sorted({p.backend for _, preds in rows for p in preds})
    series = {b: [(n, p.seconds) for n, preds in rows for p in preds if p.backend == b] for b in backends}
    series["floor"] = [(n, min(p.floor_s for p in preds)) for n, preds in rows]
    return lines_svg(series, title, "rollout replicas (log scale)", "seconds per update", dashed={"floor"})


def lines_svg(series: dict[str, list[tuple[float, float]]], title: str, x_label: str, y_label: str, *,
              log_x: bool = True, dashed: Collection[str] = (), grey: Collection[str] = (),
              colors: dict[str, str] | None = None) -> str:
    """Named series of (x, y) points as an SVG line plot (no plotting library needed): x
    at its true place (``log_x``: on a log2 axis), ticked at every x a series has; y on a
    linear axis from 0 with 6 labelled ticks; ``dashed`` series drawn dashed, ``grey`` ones
    grey, ``colors`` as named (the rest in turn); a legend on the right."""
    import math
    w, h, left, right, top_pad, bottom = 640, 360, 64, 190, 36, 48
    xs = sorted({x for pts in series.values() for x, _ in pts})
    ymax = max(y for pts in series.values() for _, y in pts) * 1.08 or 1.0
    f = math.log2 if log_x else (lambda v: v)
    lo, hi = f(min(xs)), f(max(xs))

    def at(x: float, v: float) -> tuple[float, float]:
        t = (f(x) - lo) / (hi - lo) if hi > lo else 0.5
        return left + (w - left - right) * t, h - bottom - (h - bottom - top_pad) * v / ymax

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
           f'font-size="11">', f'<text x="10" y="18" font-weight="bold">{title}</text>']
    x0, y0 = at(min(xs), 0)
    x1, _ = at(max(xs), 0)
    out.append(f'<line x1="{left}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y0:.1f}" stroke="#444"/>')
    out.append(f'<line x1="{left}" y1="{y0:.1f}" x2="{left}" y2="{top_pad}" stroke="#444"/>')
    for k in range(6):  # y ticks
        v = ymax * k / 5
        _, y = at(min(xs), v)
        out.append(f'<line x1="{left - 4}" y1="{y:.1f}" x2="{left}" y2="{y:.1f}" stroke="#444"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.3g}</text>')
    for n in xs:  # x ticks at the points' own x
        x, _ = at(n, 0)
        out.append(f'<line x1="{x:.1f}" y1="{y0:.1f}" x2="{x:.1f}" y2="{y0 + 4:.1f}" stroke="#444"/>')
        out.append(f'<text x="{x:.1f}" y="{y0 + 16:.1f}" text-anchor="middle">{n:g}</text>')
    mid = (top_pad + y0) / 2
    out.append(f'<text x="{(left + x1) / 2:.0f}" y="{h - 10}" text-anchor="middle">{x_label}</text>')
    out.append(f'<text x="14" y="{mid:.0f}" transform="rotate(-90 14 {mid:.0f})" '
               f'text-anchor="middle">{y_label}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = "#999999" if name in grey else (colors or {}).get(name, _COLORS[i % len(_COLORS)])
        dash = ' stroke-dasharray="5,4"' if name in dashed else ""
        line = " ".join(f"{x:.1f},{y:.1f}" for x, y in (at(n, v) for n, v in pts))
        out.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        out += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>'
                for x, y in (at(n, v) for n, v in pts)]
        ly = top_pad + 14 * i
        out.append(f'<line x1="{w - right + 12}" y1="{ly - 4}" x2="{w - right + 32}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2"{dash}/>')
        out.append(f'<text x="{w - right + 36}" y="{ly}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def check_model(model: str) -> str:
    """``model`` if the planner can read its shapes (a PlanError naming the choices if not)."""
    model_shapes(model)
    return model


__all__ = ["PlanError", "Question", "answer", "as_json", "check_model", "lines_svg", "sweep", "sweep_all",
           "sweep_svg", "sweep_text", "table"]
