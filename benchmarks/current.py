"""The table that opens benchmarks/RESULTS.md: one row per result file in
benchmarks/results/ (what `weightbus bench`, `benchmarks/vllm_gpu.sh` and
`benchmarks/sglang_gpu.sh` wrote), each with its value, floor, ratio, device, the command
that measures it again, and the commit that recorded it; a row whose hot path (engines,
buffers, plan, sources, sinks, integrations) changed since that commit says so.

    python benchmarks/current.py           # rewrite the table in RESULTS.md
    python benchmarks/current.py --check   # exit 1 if RESULTS.md's table is not what this writes
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN, END = "<!-- current table: benchmarks/current.py -->", "<!-- end of the current table -->"
HOT = ["weightbus/engines", "weightbus/packing", "weightbus/buffers.py", "weightbus/plan.py",
       "weightbus/sources.py", "weightbus/sinks.py", "weightbus/integrations", "weightbus/quant"]


def _git(*args: str) -> str:
    out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip()


def _recorded(path: Path) -> tuple[str, str]:
    """The commit that last wrote ``path``, and whether the hot path changed since."""
    commit = _git("log", "-1", "--format=%h", "--", str(path.relative_to(ROOT)))
    if not commit:
        return "(uncommitted)", ""
    changed = _git("diff", "--name-only", commit, "HEAD", "--", *HOT)
    return commit, "code changed since" if changed else ""


def _bench_rows(path: Path, data: list[dict]) -> list[list[str]]:
    out = []
    for r in data:
        if not r.get("weightbus_s"):
            continue
        scenario = "disaggregated" if r["scenario"].startswith("disagg ") else r["scenario"]
        stress = re.fullmatch(r"(\d+)x(\d+)B", r["preset"])  # (a stress preset: N tensors of B bytes)
        what_ = f"--tensors {stress[1]} --tensor-bytes {stress[2]}" if stress else \
            f"--preset {r['preset'].split('/')[0]}"
        cmd = f"weightbus bench --scenario {scenario} {what_}"
        if "/" in r["preset"]:
            cmd += f" --layers {r['preset'].split('/')[1].rstrip('L')}"
        if r.get("trainer_dtype"):
            cmd += f" --trainer-dtype {r['trainer_dtype']}"
        if r.get("rollout_tp"):  # (the sharded rows: one replica of N ranks, or R of them)
            cmd += f" --rollout-tp {r['rollout_tp']}"
            cmd += f" --replicas {r['replicas']}" if r.get("replicas", 1) > 1 else ""
            cmd += f" --relay {r['relay']}" if r.get("relay") else ""
        what = f"{r['scenario']}, {r['preset']}, {r['tensors']:,} tensors"
        dev = r.get("device", "")
        # (a sharded or relayed row: its own floor where the bench measured one, the trainer's
        # bytes sent raw point to point; older files have the broadcast's only)
        rows = [(what, r["weightbus_s"], r["floor_s"])]
        if r.get("sharded_s"):
            rows.append((f"{what}: sharded TP={r['rollout_tp']}", r["sharded_s"],
                         r.get("sharded_floor_s") or r["floor_s"]))
        if r.get("relayed_s"):
            rows.append((f"{what}: sharded, relay={r['relay']}, {r['replicas']} replica(s)", r["relayed_s"],
                         r.get("relayed_floor_s") or r["floor_s"]))
        if r.get("delta_s"):  # (delta rows: the dense rows' floors; the command names the fraction)
            cmd += f" --delta {r['delta_fraction']}"
            rows.append((f"{what}: delta, {r['delta_fraction']:.0%} changed", r["delta_s"], r["floor_s"]))
        if r.get("sharded_delta_s"):
            rows.append((f"{what}: sharded delta, {r['delta_fraction']:.0%} changed "
                         f"({r['sharded_delta_vs_sharded']:.2f}x the sharded row)", r["sharded_delta_s"],
                         r.get("sharded_floor_s") or r["floor_s"]))
        out += [[w, f"{t * 1e3:.1f} ms", f"{f * 1e3:.1f} ms", f"{t / f:.2f}x", dev, f"`{cmd}`"]
                for w, t, f in rows]
    return out


def _engine_rows(path: Path, data: list[dict]) -> list[list[str]]:
    out = []
    engine = "vLLM" if "vllm" in path.name else "SGLang"
    script = "vllm_gpu.sh" if engine == "vLLM" else "sglang_gpu.sh"
    floor = {(r.get("preset"), r.get("layers"), r.get("mode")): r["s"]
             for r in data if r.get("row") == "bulk copy"}
    for r in data:
        if r.get("row") == "bulk copy" or not r.get("s"):
            continue
        version = r.get("vllm") or r.get("sglang")
        f = floor.get((r.get("preset"), r.get("layers"), r.get("mode")))
        what = f"into {engine} {version}: {r['row']}, {r['preset']}/{r['layers']}L" + \
               (f" ({r['mode']})" if r.get("mode") else "")
        out.append([what, f"{r['s'] * 1e3:.1f} ms", f"{f * 1e3:.1f} ms (bulk copy)" if f else "-",
                    f"{r['s'] / f:.2f}x" if f else "-", r.get("gpu", "").removeprefix("NVIDIA "),
                    f"`bash benchmarks/{script} speed`"])
    return out


def table() -> str:
    rows = []
    for path in sorted((ROOT / "benchmarks" / "results").iterdir()):
        if path.suffix == ".json":
            data = json.loads(path.read_text())
            got = _bench_rows(path, data if isinstance(data, list) else [data])
        elif path.suffix == ".jsonl" and "speed" in path.name:
            lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            got = _engine_rows(path, lines)
        else:
            continue
        commit, stale = _recorded(path)
        rows += [[*r, f"{commit} {stale}".strip(), f"`{path.name}`"] for r in got]
    head = ["what", "weightbus", "floor", "ratio", "device", "measure again", "commit", "file"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join([BEGIN, "", *lines, "", END])


def main() -> int:
    text = RESULTS.read_text()
    new = table()
    if BEGIN in text:
        start, end = text.index(BEGIN), text.index(END) + len(END)
        updated = text[:start] + new + text[end:]
    else:
        first = text.index("\n## ")
        intro = ("\n\n## Current numbers\n\nOne row per measurement kept in `benchmarks/results/`, written "
                 "by `python benchmarks/current.py` (CI checks it is current); a row marked \"code changed "
                 "since\" measured code that has changed since its commit. The history follows.\n\n")
        updated = text[:first] + intro + new + text[first:]
    if "--check" in sys.argv:
        if updated != text:
            print("benchmarks/RESULTS.md's current table is out of date: python benchmarks/current.py")
            return 1
        return 0
    RESULTS.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
