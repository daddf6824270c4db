"""Layer 6: the ``weightbus`` command."""

from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    if args.rollout == "vllm":
        return _demo_vllm(args)
    from weightbus.demo import DemoConfig, run_demo

    cfg = DemoConfig(backend=args.backend, trainers=args.trainers, rollouts=args.rollouts,
                     steps=args.steps, dim=args.dim, layers=args.layers, bucket_mb=args.bucket_mb)
    print(f"weightbus demo: {cfg.trainers} FSDP2 trainer ranks (gloo) -> {cfg.rollouts} rollout "
          f"ranks over '{cfg.backend}', {cfg.steps} optimizer steps, bf16 on the wire", flush=True)
    rows = run_demo(cfg)
    print(f"{'update':>6} {'loss':>8} {'MB':>8} {'seconds':>8} {'GB/s':>7} {'fsdp gather s':>13} "
          f"{'floor GB/s':>10} {'ratio':>6}  check")
    for r in rows:
        floor = r.get("floor_gbps")
        ratio = f"{r['seconds'] / r['floor_seconds']:.2f}x" if floor else "-"
        print(f"{r['step']:>6} {r['loss']:>8.4f} {r['bytes'] / 1e6:>8.1f} {r['seconds']:>8.3f} "
              f"{r['gbps']:>7.2f} {r['gather_seconds']:>13.3f} {floor or 0:>10.2f} {ratio:>6}  "
              f"{'bitwise OK' if r['verified'] else 'MISMATCH'}")
    if rows and rows[0].get("floor_gbps"):
        print("floor: a raw broadcast of the same buckets over the same groups, best of 3, same run;\n"
              "fsdp gather: the trainers' own gathering of their shards, included in 'seconds'")
    return _verified(rows, args.json)


def _verified(rows: list[dict], json_path: str | None) -> int:
    """Write the rows if asked; the exit code: 0 when every update was verified."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["verified"] for r in rows) else 1


def _demo_vllm(args: argparse.Namespace) -> int:
    try:
        import vllm  # noqa: F401
    except ImportError:
        print("--rollout vllm needs vLLM: pip install 'weightbus[vllm]' (make test-vllm builds "
              ".venv-vllm with the CPU build)", file=sys.stderr)
        return 2
    from weightbus.integrations.vllm.demo import run_vllm_demo

    print(f"weightbus demo: {args.trainers} FSDP2 trainer ranks (gloo) -> a vLLM engine (native "
          f"'weightbus' backend) over '{args.backend}', {args.steps} optimizer steps, fp32", flush=True)
    rows = run_vllm_demo(trainers=args.trainers, steps=args.steps, backend=args.backend)
    print(f"{'update':>6} {'loss':>8} {'MB':>8} {'seconds':>8} {'transfer s':>10} "
          f"{'vLLM version':>12}  check")
    for r in rows:
        print(f"{r['step']:>6} {r['loss']:>8.4f} {r['bytes'] / 1e6:>8.1f} {r['seconds']:>8.3f} "
              f"{r['transfer_seconds']:>10.3f} {r['version']:>12}  "
              f"{'vLLM == transformers' if r['verified'] else 'MISMATCH'}")
    print("seconds: pause (keep) -> transfer into vLLM's load_weights -> finish -> resume;\n"
          "check: vLLM's greedy tokens equal the trainers' transformers model, and changed")
    return _verified(rows, args.json)


def _bench(args: argparse.Namespace) -> int:
    import torch

    from weightbus.bench import SCENARIOS, main_bench

    gpu = torch.cuda.is_available()
    scenarios = args.scenario or [s for s in SCENARIOS if gpu or not s.endswith("-direct")]
    if gpu and torch.cuda.device_count() < 2:
        scenarios = [s for s in scenarios if s.startswith("colocated")]
        print("one GPU: only the colocated scenario runs", flush=True)
    presets_ = args.preset or (["8b"] if gpu else ["tiny"])
    return main_bench(scenarios, presets_, args.iters, args.bucket_mb, args.json)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="weightbus", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a small transformer and sync it to rollout ranks, verified")
    d.add_argument("--backend", default="gloo", help="engine backend (default: gloo)")
    d.add_argument("--rollout", choices=["torch", "vllm"], default="torch",
                   help="rollout ranks: plain torch modules (default) or a real vLLM engine")
    d.add_argument("--trainers", type=int, default=2)
    d.add_argument("--rollouts", type=int, default=2)
    d.add_argument("--steps", type=int, default=3)
    d.add_argument("--dim", type=int, default=512)
    d.add_argument("--layers", type=int, default=4)
    d.add_argument("--bucket-mb", type=int, default=16)
    d.add_argument("--json", help="also write the rows as JSON to this file")
    d.set_defaults(fn=_demo)
    b = sub.add_parser("bench", help="model-shaped syncs next to their floors, measured in one run")
    b.add_argument("--scenario", action="append",
                   choices=["colocated", "colocated-direct", "disaggregated", "hybrid-fsdp",
                            "hybrid-fsdp-direct"], help="repeatable; default: all")
    b.add_argument("--preset", action="append",
                   help="tiny, 0.6b, 8b, 32b (repeatable; default: tiny on CPU, 8b on GPU)")
    b.add_argument("--iters", type=int, default=5)
    b.add_argument("--bucket-mb", type=int, help="default: sized from free memory")
    b.add_argument("--json", help="write the rows as JSON to this file")
    b.set_defaults(fn=_bench)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
