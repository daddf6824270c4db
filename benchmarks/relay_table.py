"""The relay table (issue 54): rows of ``benchmarks/relay_gpu.sh`` (``weightbus bench``
JSON) with the planner's prediction for each beside it.

    python benchmarks/relay_table.py results/r8x1.json results/r8x2.json ... [--cluster h100] [--plot F]

For every row (one trainer GPU to ``replicas`` replicas of ``rollout_tp`` GPUs): the broadcast,
the sharded update fed by the trainer (direct) and, where measured, relayed between the
replicas, each in ms with its floor measured in the same run (a raw broadcast of the bucket
bytes; the trainer's bytes sent point to point) and the ratio, then the planner's prediction
(:func:`weightbus.planning.simulate.simulate` on the bench's own layout and bucket size) and
measured / predicted. ``--plot``: the fan-out curve of one preset (the first row's) as an
SVG, ms against replicas: each update measured (solid) and as the planner predicts it
(dashed), and the floors (grey)."""

from __future__ import annotations

import argparse
import json

from weightbus.packing.shards import ShardLayout
from weightbus.planning import presets
from weightbus.planning.cluster import Layout, cluster
from weightbus.planning.planner import lines_svg
from weightbus.planning.simulate import Shards, manifest_of, simulate
from weightbus.tools.bench import _tp_box


def predictions(row: dict, cluster_name: str) -> dict[str, float]:
    """ms the planner predicts for the row's broadcast, direct and relayed updates (with
    the row's own relay fan-out)."""
    preset, _, layers = row["preset"].partition("/")
    manifest = manifest_of(presets.shapes(preset, int(layers.removesuffix("L")) if layers else None))
    tp, reps = row["rollout_tp"], row.get("replicas", 1)
    layouts = [ShardLayout({m.name: [_tp_box(m.shape, r, tp)] for m in manifest.metas}) for r in range(tp)]
    shards = Shards(manifest, tp, layouts)
    c, lay = cluster(cluster_name), Layout(1, reps, tp)
    out = {}
    for key, backend in (("broadcast", "nccl"), ("sharded", "sharded"), ("relayed", "sharded-relay")):
        p = simulate(c, lay, manifest, backend, bucket_size=row["bucket_bytes"], shards=shards,
                     relay=row.get("relay") if backend == "sharded-relay" else None)
        out[key] = p.seconds * 1e3
    return out


def table(rows: list[dict], preds: list[dict[str, float]]) -> str:
    """The markdown table: ``preds[i]`` is :func:`predictions` of ``rows[i]``."""
    lines = ["| row | replicas x TP | update | measured ms | floor ms | ratio | planner ms "
             "| measured / planner |",
             "|---|---|---|---|---|---|---|---|"]
    for r, pred in zip(rows, preds, strict=True):
        name = f"{r['preset']}, {r.get('device', '')}"
        shape = f"{r.get('replicas', 1)} x {r['rollout_tp']}"
        cells = [("broadcast (nccl)", r["weightbus_s"], r["floor_s"], pred["broadcast"]),
                 ("sharded, direct", r["sharded_s"], r.get("sharded_floor_s"), pred["sharded"])]
        if r.get("relayed_s") is not None:
            k = r["relay"]
            cells.append((f"sharded, relay={k} ({'chain' if k == 1 else f'{k}-ary tree'})", r["relayed_s"],
                          r.get("relayed_floor_s"), pred["relayed"]))
        for what, got, floor, want in cells:
            fl = f"{floor * 1e3:.1f}" if floor else "-"
            ratio = f"{got / floor:.2f}x" if floor else "-"
            lines.append(f"| {name} | {shape} | {what} | {got * 1e3:.1f} | {fl} | {ratio} | {want:.1f} | "
                         f"{got * 1e3 / want:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], preds: list[dict[str, float]]) -> str:
    """The fan-out curve of the first row's preset (chains only: the planner's pick), with
    ``preds[i]`` the planner's for ``rows[i]``."""
    preset = rows[0]["preset"]
    mine = sorted(((r, p) for r, p in zip(rows, preds, strict=True)
                   if r["preset"] == preset and r.get("relay", 1) == 1),
                  key=lambda rp: rp[0].get("replicas", 1))
    kinds = (("weightbus_s", "broadcast", "floor_s", "broadcast"),
             ("sharded_s", "direct", "sharded_floor_s", "sharded"),
             ("relayed_s", "relay=1", "relayed_floor_s", "relayed"))
    series: dict[str, list[tuple[float, float]]] = {}
    for r, pred in mine:
        n = r.get("replicas", 1)
        for key, name, floor, planned in kinds:
            if r.get(key) is None:
                continue
            series.setdefault(name, []).append((n, r[key] * 1e3))
            series.setdefault(f"{name}, planner", []).append((n, pred[planned]))
            if r.get(floor):
                series.setdefault(f"{name} floor", []).append((n, r[floor] * 1e3))
    title = f"one trainer GPU to replicas of one GPU, {preset} ({mine[0][0].get('device', '')})"
    hue = dict(zip(("broadcast", "direct", "relay=1"), ("#3070c0", "#d06020", "#30a050"), strict=True))
    return lines_svg(series, title, "replicas", "ms per update", log_x=False,
                     dashed={k for k in series if k.endswith("planner")},
                     grey={k for k in series if k.endswith("floor")},
                     colors={k: hue[k.split(",")[0].removesuffix(" floor")] for k in series})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="bench JSON files (each a list of rows)")
    ap.add_argument("--cluster", default="h100", help="the planner's cluster (weightbus plan --cluster)")
    ap.add_argument("--plot", metavar="FILE", help="also draw the fan-out curve into this SVG file")
    args = ap.parse_args()
    rows = []
    for path in args.json:
        with open(path) as f:
            got = json.load(f)
        rows += [r for r in (got if isinstance(got, list) else got.get("rows", [got])) if r.get("rollout_tp")]
    preds = [predictions(r, args.cluster) for r in rows]  # (once: the table and the plot share them)
    print(table(rows, preds))
    if args.plot:
        with open(args.plot, "w") as f:
            f.write(plot(rows, preds))


if __name__ == "__main__":
    main()
