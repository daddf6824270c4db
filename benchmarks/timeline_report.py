"""Lines up the timelines that ``benchmarks/timeline/sitecustomize.py`` recorded: per delta
update (from the trainer's header to its settled outcome), every rank's steps in ms from
that start, and each rank's time per step.

    python benchmarks/timeline_report.py DIR [--last N] [--events]
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--last", type=int, default=3, help="updates to show (the last N)")
    ap.add_argument("--events", action="store_true", help="every step, not only the sums")
    args = ap.parse_args()
    procs: dict[str, list[tuple[str, float, float]]] = {}
    for name in sorted(os.listdir(args.dir)):
        evs = []
        with open(os.path.join(args.dir, name)) as f:
            for line in f:
                evs += [tuple(e) for e in json.loads(line)]
        procs[name.split(".")[0]] = sorted(evs, key=lambda e: e[1])
    trainers = [p for p, evs in procs.items() if any(e[0] == "T.update" for e in evs)]
    if not trainers:
        raise SystemExit("no trainer's delta update recorded")
    t0p = trainers[0]
    tev = procs[t0p]
    ups = [e for e in tev if e[0] == "T.update"]
    names = {p: ("trainer" if p in trainers else "rollout") + f" {p}" for p in procs}
    for u in ups[-args.last:]:
        heads = [e for e in tev if e[0] == "exchange_header" and e[1] <= u[1]]
        fins = [e for e in tev if e[0] == "finish_settled" and e[1] >= u[2]]
        w0 = heads[-1][1] if heads else u[1]
        w1 = fins[0][2] if fins else u[2]
        print(f"=== update at {w0:.3f}: {1e3 * (w1 - w0):.2f} ms header to outcome on {names[t0p]}")
        for p, evs in procs.items():
            mine = [e for e in evs if w0 - 0.002 <= e[1] <= w1]
            sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for label, a, b in mine:
                sums[label][0] += 1e3 * (b - a)
                sums[label][1] += 1
            ranked = sorted(sums.items(), key=lambda kv: -kv[1][0])
            line = ", ".join(f"{k} {v[0]:.2f}/{v[1]}" for k, v in ranked)
            print(f"  {names[p]}: {line}")
        if args.events:
            rows = sorted(((e, p) for p, evs in procs.items() for e in evs if w0 - 0.002 <= e[1] <= w1),
                          key=lambda r: r[0][1])
            for (label, a, b), p in rows:
                print(f"    {1e3 * (a - w0):8.2f} {1e3 * (b - w0):8.2f}  {1e3 * (b - a):7.2f}  "
                      f"{names[p][:7]:7} {label}")


if __name__ == "__main__":
    main()
