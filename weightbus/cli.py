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
              "fsdp gather: the trainers' own gathering of their shards, included in 'seconds'.\n"
              "Why the ratio is far from 1 here: a small model (tens of MB) on a CPU whose processes share\n"
              "its cores, so an update is dominated by fixed costs the floor does not pay (the FSDP\n"
              "gathers, the header and status round trips, every rank's check). On GPUs with real\n"
              "models the NCCL path runs at 1.13-1.24x of a raw broadcast: benchmarks/RESULTS.md.")
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

    from weightbus import presets
    from weightbus.bench import SCENARIOS, BenchConfig, main_bench

    gpu = torch.cuda.is_available()
    names = args.preset or (["8b"] if gpu else ["tiny"])
    if args.tensors is not None or args.tensor_bytes is not None:
        try:
            names = [presets.stress(args.tensors or 100_000, args.tensor_bytes or 1024)]
        except ValueError as e:
            print(f"weightbus bench: {e}", file=sys.stderr)
            return 2
    scenarios = args.scenario or [s for s in SCENARIOS if gpu or not s.endswith("-direct")]
    engines: list[str | None] = args.backend or [None]
    if args.backend or args.receivers != 1:  # they are the disaggregated scenario's knobs
        if args.scenario and set(args.scenario) != {"disaggregated"}:
            print("weightbus bench: --backend and --receivers apply to --scenario disaggregated only",
                  file=sys.stderr)
            return 2
        scenarios = ["disaggregated"]
    if gpu and torch.cuda.device_count() < 2:
        dropped = [s for s in scenarios if not s.startswith("colocated")]
        scenarios = [s for s in scenarios if s.startswith("colocated")]
        if dropped:
            print(f"one GPU: not running {', '.join(dropped)} (they need 2)", flush=True)
    try:  # every argument checked before anything starts
        configs = [BenchConfig(scenario=s, preset=p, iters=args.iters, bucket_mb=args.bucket_mb,
                               trainer_dtype=args.trainer_dtype, layers=args.layers, backend=e,
                               receivers=args.receivers,
                               topology=args.topology if e == "nixl" else None,
                               delta=args.delta if s == "disaggregated" else None)
                   for p in names for s in scenarios for e in engines]
    except ValueError as e:
        print(f"weightbus bench: {e}", file=sys.stderr)
        return 2
    return main_bench(configs, args.json, args.plot, log=lambda m: print(m, flush=True))


class _Defaults(argparse.HelpFormatter):
    """Shows an option's default where it has one (and its help does not say it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS, False) and "default" not in text:
            text += " (default: %(default)s)"
        return text


def main(argv: list[str] | None = None) -> int:
    from weightbus import __version__
    p = argparse.ArgumentParser(prog="weightbus", description="Move model weights from RL trainers to "
                                "rollout engines; demos and benchmarks.")
    p.add_argument("--version", action="version", version=f"weightbus {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="train a small transformer and sync it to rollout ranks, verified",
                       formatter_class=_Defaults)
    from weightbus.engines.api import CheckpointEngineRegistry
    d.add_argument("--backend", default="gloo", choices=CheckpointEngineRegistry.names(),
                   help="engine backend (default: gloo)")
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
    from weightbus import presets
    from weightbus.bench import DISAGG_BACKENDS, SCENARIOS, TRAINER_DTYPES
    b = sub.add_parser("bench", help="model-shaped syncs next to their floors, measured in one run",
                       formatter_class=_Defaults)
    b.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help="repeatable; default: every one this machine can run")
    b.add_argument("--preset", action="append", choices=presets.names(), metavar="PRESET",
                   help=f"repeatable, one of {', '.join(presets.names())}; default: tiny on CPU, 8b on GPU")
    b.add_argument("--layers", type=int, help="keep only the first N decoder layers of the preset")
    b.add_argument("--tensors", type=int, help="stress preset: N flat tensors (default 100000 if "
                   "--tensor-bytes is given)")
    b.add_argument("--tensor-bytes", type=int, help="stress preset: bf16 bytes per tensor "
                   "(default 1024 if --tensors is given)")
    b.add_argument("--trainer-dtype", choices=list(TRAINER_DTYPES), default="fp32",
                   help="the trainer's weights (bf16 on the wire either way)")
    b.add_argument("--backend", action="append", choices=list(DISAGG_BACKENDS),
                   help="repeatable: the disaggregated scenario's engine, each next to its own raw "
                        "transfer (default: nccl on a GPU, gloo without)")
    b.add_argument("--receivers", type=int, default=1,
                   help="rollout ranks of the disaggregated scenario (CPU: processes of this host)")
    b.add_argument("--topology", choices=["auto", "chain", "tree", "direct"],
                   help="the nixl engine's forwarding tree (default auto: a chain on equal links)")
    b.add_argument("--delta", type=float, metavar="FRACTION",
                   help="disaggregated: each round change this fraction of the trainer's elements "
                        "(one bf16 step each) and time a delta-mode update next to the dense one")
    b.add_argument("--iters", type=int, default=5, help="timed iterations, after one warm-up")
    b.add_argument("--bucket-mb", type=int, help="bucket size in MiB (default: sized from free memory)")
    b.add_argument("--json", help="write the rows as JSON to this file")
    b.add_argument("--plot", help="draw weightbus next to its floor per row into this SVG file")
    b.set_defaults(fn=_bench)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
