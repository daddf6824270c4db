"""The relay table (issue 54): rows of ``benchmarks/relay_gpu.sh`` (``weightbus bench``
JSON) with the planner's prediction for each beside it.

    python benchmarks/relay_table.py results/r8x1.json results/r8x2.json ... [--cluster h100]

For every row (one trainer GPU to ``replicas`` replicas of ``rollout_tp`` GPUs): the broadcast,
the sharded update fed by the trainer (direct) and, where measured, relayed between the
replicas, each in ms with its floor measured in the same run (a raw broadcast of the bucket
bytes; the trainer's bytes sent point to point) and the ratio, then the planner's prediction
(:func:`weightbus.planning.simulate.simulate` on the bench's own layout and bucket size) and
measured / predicted."""

from __future__ import annotations

import argparse
import json

from weightbus.packing.shards import ShardLayout
from weightbus.planning import presets
from weightbus.planning.cluster import Layout, cluster
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


def table(rows: list[dict], cluster_name: str) -> str:
    lines = ["| row | replicas x TP | update | measured ms | floor ms | ratio | planner ms "
             "| measured / planner |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pred = predictions(r, cluster_name)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", nargs="+", help="bench JSON files (each a list of rows)")
    ap.add_argument("--cluster", default="h100", help="the planner's cluster (weightbus plan --cluster)")
    args = ap.parse_args()
    rows = []
    for path in args.json:
        with open(path) as f:
            got = json.load(f)
        rows += [r for r in (got if isinstance(got, list) else got.get("rows", [got])) if r.get("rollout_tp")]
    print(table(rows, args.cluster))


if __name__ == "__main__":
    main()
