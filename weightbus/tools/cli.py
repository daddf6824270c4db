"""Layer 6: the ``weightbus`` command.

Every option is checked before anything starts (a process, a model, an engine): a bad
value ends in one line that names the option, the value and what would do, exit code 2
as argparse's own errors.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import json
import math
import os
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from weightbus.tools.demo import DemoConfig


class _Parser(argparse.ArgumentParser):
    """An error is one line (what is wrong and the fix), not the usage block before it; a
    mistyped option or choice gets the nearest one suggested."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{_suggestion(self, message)}\n")


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """``; did you mean X?`` for a mistyped choice or option in ``message`` (argparse's)."""
    import difflib
    import re
    m = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if m:
        choices = re.findall(r"'([^']*)'", m.group(2)) or [c.strip() for c in m.group(2).split(",")]
        close = difflib.get_close_matches(m.group(1), choices, n=1, cutoff=0.5)
        return f"; did you mean {close[0]!r}?" if close else ""
    m = re.search(r"unrecognized arguments: (.*)", message)
    if m:
        options: set[str] = set()
        parsers = [parser]
        while parsers:
            p = parsers.pop()
            options.update(p._option_string_actions)
            for action in p._actions:
                if isinstance(action, argparse._SubParsersAction):
                    parsers.extend(action.choices.values())
        hints = []
        for tok in m.group(1).split():
            if tok.startswith("-"):
                close = difflib.get_close_matches(tok.split("=")[0], sorted(options), n=1, cutoff=0.6)
                if close:
                    hints.append(f"{tok} -> {close[0]}")
        return f"; did you mean {', '.join(hints)}?" if hints else ""
    return ""


def _int(lo: int, hi: int | None = None, *, multiple: int = 1, what: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi], a multiple of ``multiple``; the error names
    the value and the range (argparse adds the option's name)."""

    def parse(text: str) -> int:
        need = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        if multiple > 1:
            need += f" that is a multiple of {multiple}"
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"got {text!r}, need {need}{what}") from None
        if n < lo or (hi is not None and n > hi) or n % multiple:
            hint = f", e.g. {max(lo, -(-n // multiple) * multiple)}" if lo <= n and n % multiple else ""
            raise argparse.ArgumentTypeError(f"got {n}, need {need}{what}{hint}")
        return n
    return parse


def _fraction(text: str) -> float:
    """An argparse type: a fraction in (0, 1]."""
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not 0 < x <= 1:  # (also NaN)
        raise argparse.ArgumentTypeError(f"got {text!r}, need a fraction of the elements in (0, 1], "
                                         f"e.g. 0.01")
    return x


def _out_file(text: str) -> str:
    """An argparse type: a file this process can write (its directory exists)."""
    where = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory: give a file name in it")
    if not os.path.isdir(where):
        raise argparse.ArgumentTypeError(f"{text!r}: the directory {where} does not exist: create it "
                                         f"or give a path in an existing one")
    if not os.access(where, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text!r}: the directory {where} is not writable for this user")
    return text


def _directory(text: str) -> str:
    """An argparse type: an existing directory this process can make a directory in
    (tried: permissions alone do not say it, e.g. for root in /proc)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory: create it or give another")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".weightbus-probe-", dir=text))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: cannot make a directory there ({e.strerror}): give a "
                                         f"writable directory") from None
    return text


def _backend_missing(name: str) -> str | None:
    """Why engine ``name`` cannot run on this machine (None if it can), found without
    starting anything: its hardware or package is missing."""
    import torch

    from weightbus.errors import PlanError
    if name == "nccl" and not torch.cuda.is_available():
        return "--backend nccl needs CUDA GPUs, and this machine has none: use --backend gloo"
    if name == "hccl" and importlib.util.find_spec("torch_npu") is None:
        return "--backend hccl needs Ascend NPUs (torch_npu), not installed here: use --backend gloo"
    if name in ("nixl", "mooncake"):
        from weightbus.engines import mooncake, nixl
        try:
            (nixl._nixl_api if name == "nixl" else mooncake._mooncake_api)()
        except PlanError as e:
            return f"--backend {name}: {e}"
    return None


def _progress_to(fd: int) -> Callable[[str], None]:
    """A line per step of a long command, on the terminal ``fd`` is (nothing when it is not
    one: a pipe or a file gets only the results)."""
    if not os.isatty(fd):
        return lambda line: None

    def say(line: str) -> None:
        os.write(fd, f"  ... {line}\n".encode())
    return say


@contextlib.contextmanager
def _logs_to_file(verbose: bool) -> Iterator[Callable[[str], None]]:
    """Unless ``verbose``: what the demo's processes print while it runs (the engines' own
    logs and warnings; child processes inherit the descriptors) goes to a log file, named
    in one line when it holds anything, so the table stays readable. Yields where to say
    each step as it happens (the terminal, if there is one)."""
    if verbose:
        yield _progress_to(1)
        return
    fd, path = tempfile.mkstemp(prefix="weightbus-demo-", suffix=".log")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    failed = True
    interrupted = False
    try:
        yield _progress_to(saved[0])
        failed = False
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, held in enumerate(saved, 1):
            os.dup2(held, target)
            os.close(held)
        with open(path, "rb") as f:
            lines = f.read().count(b"\n")
        if interrupted:  # (what the ended workers said is no news: one line says it all)
            os.unlink(path)
        elif lines or failed:
            print(f"engine logs ({lines} lines, --verbose shows them here): {path}",
                  file=sys.stderr if failed else sys.stdout, flush=True)
        else:
            os.unlink(path)


def _check_demo(args: argparse.Namespace, error: Callable[[str], NoReturn]) -> None:
    """What no single option's type can check: options that need others, the machine."""
    from weightbus.tools.demo import CACHE_BACKENDS
    vllm = args.rollout == "vllm"
    if vllm:
        if args.backend in CACHE_BACKENDS:
            error(f"--rollout vllm updates vLLM in step with the trainers; --backend {args.backend} is a "
                  f"cache its readers pull from: use --backend gloo (or colocated, nixl, mooncake), or "
                  f"--rollout torch")
        if args.rollouts not in (None, 1):
            error(f"--rollouts {args.rollouts}: --rollout vllm runs one vLLM engine; more rollout ranks "
                  f"are for --rollout torch")
        if args.dim is not None and args.dim % 128:
            error(f"--dim {args.dim}: --rollout vllm makes a Qwen2 of 64-wide heads in pairs of KV heads: "
                  f"give a multiple of 128, e.g. {max(128, args.dim // 128 * 128)}")
    if args.cache_dir is not None and args.backend != "disk":
        error(f"--cache-dir is where --backend disk keeps its cache; with --backend {args.backend} it "
              f"would do nothing: add --backend disk, or drop --cache-dir")
    if args.bucket_mb is not None and args.backend in CACHE_BACKENDS:
        error(f"--bucket-mb: --backend {args.backend} writes whole versions into its cache, without "
              f"buckets: drop --bucket-mb")
    if vllm and importlib.util.find_spec("vllm") is None:  # (not imported: it logs on import)
        error("--rollout vllm needs vLLM: pip install 'weightbus[vllm]' (make demo-vllm builds "
              ".venv-vllm with the CPU build)")
    why = _backend_missing(args.backend)
    if why:
        error(why)
    if not vllm:
        cfg = _demo_config(args)
        need, have = cfg.host_bytes(), _available_memory()
        if have is not None and need > have:
            error(f"--dim {cfg.dim} --layers {cfg.layers} with {cfg.trainers} + {cfg.rollouts} ranks needs "
                  f"~{need / 2**30:.1f} GiB of host memory, {have / 2**30:.1f} GiB is available: lower "
                  f"--dim, --layers, --bucket-mb or the ranks")
        from weightbus.packing.buffers import shm_room
        room, shm = shm_room(), cfg.shm_bytes()
        if room is not None and shm > room:
            error(f"--backend {cfg.backend} needs ~{shm / 2**20:.0f} MiB in /dev/shm, which has "
                  f"{room / 2**20:.0f} MiB free: lower --dim, --layers or --bucket-mb, or use --backend gloo")


def _available_memory() -> int | None:
    """Host memory available to new processes (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _demo_config(args: argparse.Namespace) -> DemoConfig:
    from weightbus.tools.demo import DemoConfig
    return DemoConfig(backend=args.backend, trainers=args.trainers, rollouts=args.rollouts or 2,
                      steps=args.steps, dim=args.dim or 512, layers=args.layers,
                      bucket_mb=args.bucket_mb or 16, cache_dir=args.cache_dir)


def _demo(args: argparse.Namespace) -> int:
    _check_demo(args, args.parser.error)
    if args.rollout == "vllm":
        return _demo_vllm(args)
    from weightbus.tools.demo import at_scale_note, floor_note, run_demo

    cfg = _demo_config(args)
    where = f" (cache in {cfg.cache_dir or tempfile.gettempdir()})" if cfg.backend == "disk" else ""
    print(f"weightbus demo: {cfg.trainers} FSDP2 trainer ranks (gloo) -> {cfg.rollouts} rollout "
          f"ranks over '{cfg.backend}'{where}, {cfg.steps} optimizer steps, bf16 on the wire", flush=True)
    with _logs_to_file(args.verbose) as progress:
        rows = run_demo(cfg, progress)
    print(f"{'update':>6} {'loss':>8} {'MB':>8} {'seconds':>8} {'GB/s':>7} {'fsdp gather s':>13} "
          f"{'floor GB/s':>10} {'ratio':>6}  check")
    for r in rows:
        floor = r.get("floor_gbps")
        ratio = f"{r['seconds'] / r['floor_seconds']:.2f}x" if floor else "-"
        shown = f"{floor:>10.2f}" if floor else f"{'n/a':>10}"
        print(f"{r['step']:>6} {r['loss']:>8.4f} {r['bytes'] / 1e6:>8.1f} {r['seconds']:>8.3f} "
              f"{r['gbps']:>7.2f} {r['gather_seconds']:>13.3f} {shown} {ratio:>6}  "
              f"{'bitwise OK' if r['verified'] else 'MISMATCH'}")
    print(textwrap.fill(floor_note(cfg.backend), 95))
    print("fsdp gather: the trainers' own gathering of their shards, included in 'seconds'.")
    print(textwrap.fill("loss: each step trains on fresh random tokens (a stand-in workload, not meant to "
                        "learn): it need not fall; what the demo checks is that every rollout rank holds "
                        "the trainer's weights bitwise after every update.", 95))
    if rows and rows[0].get("floor_gbps"):
        print(textwrap.fill("Why the ratio is far from 1 here: a small model (tens of MB) on a CPU whose "
                            "processes share its cores, so an update is dominated by fixed costs the floor "
                            "does not pay (the FSDP gathers, the header and status round trips, every rank's "
                            f"check). {at_scale_note(cfg.backend)}", 95))
    return _verified(rows, args.json)


def _verified(rows: list[dict], json_path: str | None) -> int:
    """Write the rows if asked; the exit code: 0 when every update was verified."""
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["verified"] for r in rows) else 1


def _demo_vllm(args: argparse.Namespace) -> int:
    from weightbus.integrations.vllm.demo import run_vllm_demo

    print(f"weightbus demo: {args.trainers} FSDP2 trainer ranks (gloo) -> a vLLM engine (native "
          f"'weightbus' backend) over '{args.backend}', {args.steps} optimizer steps, fp32", flush=True)
    with _logs_to_file(args.verbose):
        rows = run_vllm_demo(trainers=args.trainers, steps=args.steps, backend=args.backend,
                             hidden=args.dim or 256, layers=args.layers, bucket_mb=args.bucket_mb)
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

    from weightbus.planning import presets
    from weightbus.tools.bench import SCENARIOS, BenchConfig, main_bench

    error: Callable[[str], NoReturn] = args.parser.error
    gpu = torch.cuda.is_available()
    names = args.preset or (["8b"] if gpu else ["tiny"])
    if args.tensors is not None or args.tensor_bytes is not None:
        if args.preset:
            error(f"--tensors/--tensor-bytes make a stress preset of their own: drop --preset "
                  f"{' --preset '.join(args.preset)}, or them")
        try:
            names = [presets.stress(args.tensors or 100_000, args.tensor_bytes or 1024)]
        except ValueError as e:
            error(str(e))
    scenarios = args.scenario or [s for s in SCENARIOS if gpu or not s.endswith("-direct")]
    engines: list[str | None] = args.backend or [None]
    # the disaggregated scenario's own knobs: they choose it, and refuse any other
    knobs = [k for k, given in (("--backend", args.backend), ("--receivers", args.receivers != 1),
                                ("--delta", args.delta is not None),
                                ("--rollout-tp", args.rollout_tp is not None),
                                ("--replicas", args.replicas != 1),
                                ("--relay", args.relay is not None),
                                ("--trainers", args.trainers != 1)) if given]
    if knobs:
        others = sorted(set(args.scenario or ()) - {"disaggregated"})
        if others:
            one = len(knobs) == 1
            error(f"{', '.join(knobs)} appl{'ies' if one else 'y'} to --scenario disaggregated only, not "
                  f"--scenario {', '.join(others)}: drop {'it' if one else 'them'}, or that scenario")
        scenarios = ["disaggregated"]
    if args.topology is not None and "nixl" not in engines:
        error(f"--topology {args.topology} shapes the nixl engine's forwarding: add --backend nixl, "
              f"or drop it")
    if args.fp8:
        others = sorted(set(args.scenario or ()) - {"colocated", "colocated-direct"})
        if others or knobs:
            error(f"--fp8 applies to the colocated scenarios only, not --scenario "
                  f"{', '.join(others or ['disaggregated'])}")
        scenarios = [s for s in scenarios if s.startswith("colocated")]
    direct = [s for s in scenarios if s.endswith("-direct")]
    if direct and not gpu:
        error(f"--scenario {direct[0]} writes straight into exported GPU memory, and this machine has no "
              f"GPU: use --scenario {direct[0].removesuffix('-direct')}")
    for e in args.backend or ():
        why = _backend_missing(e)
        if why:
            error(why)
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
                               delta=args.delta if s == "disaggregated" else None,
                               rollout_tp=args.rollout_tp if s == "disaggregated" else None,
                               replicas=args.replicas if s == "disaggregated" else 1,
                               relay=args.relay if s == "disaggregated" else None,
                               trainers=args.trainers if s == "disaggregated" else 1,
                               fp8=args.fp8)
                   for p in names for s in scenarios for e in engines]
    except ValueError as e:
        error(str(e))
    return main_bench(configs, args.json, args.plot, log=lambda m: print(m, flush=True))


class _Defaults(argparse.HelpFormatter):
    """Shows an option's default where it has one (and its help does not say it)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS, False) and "default" not in text:
            text += " (default: %(default)s)"
        return text


#: the subcommands; each one's options are added (and what they import imported) only where
#: the command line names it, so ``weightbus --help`` starts without torch
COMMANDS = ("demo", "bench", "plan")


def build_parser(commands: tuple[str, ...] = COMMANDS) -> argparse.ArgumentParser:
    """The ``weightbus`` command's parser: every option of ``commands`` with its help and
    its check (the other subcommands are listed, without their options)."""
    from weightbus import __version__
    p = _Parser(prog="weightbus", description="Move model weights from RL trainers to "
                "rollout engines; demos and benchmarks.")
    p.add_argument("--version", action="version", version=f"weightbus {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{demo,bench,plan}")
    d = sub.add_parser("demo", help="train a small transformer and sync it to rollout ranks, verified",
                       description="Train a small transformer with FSDP2 trainer ranks and send its weights "
                       "to rollout ranks after every optimizer step, each checked bitwise, next to the "
                       "floor of the same bytes measured in the same run.", formatter_class=_Defaults)
    b = sub.add_parser("bench", help="model-shaped syncs next to their floors, measured in one run",
                       description="Model-shaped weight syncs, each next to its floor measured in the same "
                       "run, every rollout tensor checked.", formatter_class=_Defaults)
    q = sub.add_parser("plan", help="simulate a weight sync on a cluster you do not have; pick a backend",
                       description="Plan a weight sync: the engines' own schedule (buckets, sharded "
                       "regions, p2p trees) played over a cluster's links at the rates measured on our "
                       "GPUs; seconds, bytes per NIC and NVLink, extra memory, the floor, per backend.",
                       formatter_class=_Defaults)
    for name, sp, add in (("demo", d, _demo_args), ("bench", b, _bench_args), ("plan", q, _plan_args)):
        if name in commands:
            add(sp)
    return p


def _demo_args(d: argparse.ArgumentParser) -> None:
    """``weightbus demo``'s options (their choices import what they name: only when used)."""
    from weightbus.engines.api import CheckpointEngineRegistry
    from weightbus.tools.demo import HEADS
    d.add_argument("--backend", default="gloo", choices=CheckpointEngineRegistry.names(),
                   help="the weightbus engine that moves the weights (default: gloo)")
    d.add_argument("--rollout", choices=["torch", "vllm"], default="torch",
                   help="rollout ranks: plain torch modules (default) or a real vLLM engine")
    d.add_argument("--trainers", type=_int(1, 64, what=" (trainer processes on this host)"), default=2,
                   help="FSDP2 trainer ranks, each a process")
    d.add_argument("--rollouts", type=_int(1, 64, what=" (rollout processes on this host)"),
                   help="rollout ranks, each a process (default: 2; --rollout vllm: its one engine)")
    d.add_argument("--steps", type=_int(1, what=" (optimizer steps, one update after each)"), default=3,
                   help="optimizer steps; the weights are sent after each one")
    d.add_argument("--dim", type=_int(HEADS, 1 << 16, multiple=HEADS, what=f" (the model's {HEADS} "
                   f"attention heads share it)"),
                   help="the model's width (default: 512; --rollout vllm: 256, a multiple of 128)")
    d.add_argument("--layers", type=_int(1, 1024, what=" (transformer blocks)"), default=4,
                   help="the model's transformer blocks")
    d.add_argument("--bucket-mb", type=_int(1, 1 << 16, what=" (MiB per bucket)"),
                   help="bucket size in MiB (default: 16; not for shm or disk, which write whole versions)")
    d.add_argument("--cache-dir", type=_directory, metavar="DIR",
                   help="--backend disk: make the cache in a fresh directory inside DIR, removed at the end "
                        f"(default: {tempfile.gettempdir()})")
    d.add_argument("--verbose", action="store_true",
                   help="print the engines' own logs and warnings here (default: into a log file, named "
                        "in one line)")
    d.add_argument("--json", type=_out_file, metavar="FILE", help="also write the rows as JSON to this file")
    d.set_defaults(fn=_demo, parser=d)


def _bench_args(b: argparse.ArgumentParser) -> None:
    """``weightbus bench``'s options (their choices import what they name: only when used)."""
    from weightbus.planning import presets
    from weightbus.tools.bench import DISAGG_BACKENDS, SCENARIOS, TRAINER_DTYPES
    b.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help="repeatable; default: every one this machine can run")
    b.add_argument("--preset", action="append", choices=presets.names(), metavar="PRESET",
                   help=f"repeatable, one of {', '.join(presets.names())}; default: tiny on CPU, 8b on GPU")
    b.add_argument("--layers", type=_int(1, what=" (decoder layers)"),
                   help="keep only the first N decoder layers of the preset")
    b.add_argument("--tensors", type=_int(1, 10_000_000, what=" (tensors of the stress preset)"),
                   help="stress preset: N flat tensors (default 100000 if --tensor-bytes is given)")
    b.add_argument("--tensor-bytes", type=_int(2, multiple=2, what=" (an even tensor size: bf16 bytes)"),
                   help="stress preset: bf16 bytes per tensor (default 1024 if --tensors is given)")
    b.add_argument("--trainer-dtype", choices=list(TRAINER_DTYPES), default="fp32",
                   help="the trainer's weights (bf16 on the wire either way)")
    b.add_argument("--backend", action="append", choices=list(DISAGG_BACKENDS),
                   help="repeatable: the disaggregated scenario's engine, each next to its own raw "
                        "transfer (default: nccl on a GPU, gloo without)")
    b.add_argument("--receivers", type=_int(1, 64, what=" (rollout processes on this host)"), default=1,
                   help="rollout ranks of the disaggregated scenario (CPU: processes of this host)")
    b.add_argument("--topology", choices=["auto", "chain", "tree", "direct"],
                   help="--backend nixl: its forwarding tree (default auto: a chain on equal links)")
    b.add_argument("--delta", type=_fraction, metavar="FRACTION",
                   help="--scenario disaggregated (chosen by it): each round change this fraction of the "
                        "trainer's elements (one bf16 step each) and time a delta-mode update next to "
                        "the dense one")
    b.add_argument("--rollout-tp", type=_int(1, 64, what=" (TP ranks of each rollout replica)"), metavar="N",
                   help="--scenario disaggregated (chosen by it): the receivers are the N tensor-parallel "
                        "ranks of one replica; also time a sharded update (each rank receives only its "
                        "rows) next to the broadcast, and print the bytes each rank received")
    b.add_argument("--replicas", type=_int(1, 64, what=" (replicas)"), default=1,
                   help="--rollout-tp N: the receivers are this many replicas of N ranks")
    b.add_argument("--relay", type=_int(1, 64, what=" (relay fan-out)"), metavar="K",
                   help="--rollout-tp N: also time the sharded update relayed between the replicas "
                        "(relay=K: 1 a chain, K a K-ary tree)")
    b.add_argument("--trainers", type=_int(1, 64, what=" (trainer processes on this host)"), default=1,
                   help="--scenario disaggregated (chosen by it): this many FSDP2 trainer ranks, each "
                        "holding its dim-0 shard of every tensor; each bucket goes from the rank that "
                        "packs it")
    b.add_argument("--fp8", action="store_true",
                   help="colocated scenarios: the rollout serves its linear weights in block fp8 (as a "
                        "Qwen3-FP8 checkpoint) and the trainer quantizes on the way; floor: one bulk cast")
    b.add_argument("--iters", type=_int(1, what=" (timed iterations)"), default=5,
                   help="timed iterations, after one warm-up")
    b.add_argument("--bucket-mb", type=_int(1, 1 << 16, what=" (MiB per bucket)"),
                   help="bucket size in MiB (default: sized from free memory)")
    b.add_argument("--json", type=_out_file, metavar="FILE", help="write the rows as JSON to this file")
    b.add_argument("--plot", type=_out_file, metavar="FILE",
                   help="draw weightbus next to its floor per row into this SVG file")
    b.set_defaults(fn=_bench, parser=b)


def _plan_args(q: argparse.ArgumentParser) -> None:
    """``weightbus plan``'s options (their choices import what they name: only when used)."""
    from weightbus.planning import presets
    from weightbus.planning.cluster import CLUSTERS, MODELS
    q.add_argument("--cluster", choices=list(CLUSTERS), default="h100", help="the nodes' kind")
    q.add_argument("--nodes", type=_int(1, 100_000, what=" (nodes)"),
                   help="nodes (default: as many as the layout needs)")
    q.add_argument("--model", type=_model, default="30b-a3b",
                   help=f"a preset ({', '.join(presets.names())}), {', '.join(MODELS)}, or a Hugging Face "
                        f"config.json (file or directory)")
    q.add_argument("--trainers", type=_int(1, 1_000_000, what=" (trainer GPUs)"), default=8,
                   help="trainer GPUs")
    q.add_argument("--senders", type=_int(1, 1_000_000, what=" (trainer GPUs that send)"),
                   help="FSDP trainer GPUs that send (default: all of them)")
    for flag, what in (("--tp", "tensor"), ("--pp", "pipeline"), ("--ep", "expert")):
        q.add_argument(flag, type=_int(1, 1024, what=f" ({what}-parallel size)"), default=1,
                       help=f"the Megatron trainers' {what}-parallel size (all 1: FSDP); one data-parallel "
                            f"replica sends, each bucket from where its tensors are")
    q.add_argument("--replicas", type=_int(1, 100_000, what=" (rollout replicas)"), default=1,
                   help="rollout replicas")
    q.add_argument("--rollout-gpus", type=_int(1, 1024, what=" (GPUs per replica)"), default=8,
                   help="GPUs per rollout replica (its TP x EP)")
    q.add_argument("--colocated", action="store_true", help="the rollouts share the trainers' GPUs (hybrid)")
    q.add_argument("--fp8", action="store_true", help="the rollout serves fp8: the trainers quantize and "
                   "send e4m3 payloads with their scales")
    q.add_argument("--delta", type=_fraction, metavar="FRACTION",
                   help="delta updates: the fraction of the elements that change per step (e.g. 0.02); "
                        "the records are sized by the delta engine's own encoding rule")
    q.add_argument("--verify-every", type=_int(0, 1 << 20, what=" (delta updates between whole checks)"),
                   default=1, metavar="N",
                   help="--delta: the receivers check their whole copy every N delta updates (the "
                        "engines' verify_every; 0: never)")
    q.add_argument("--trainer-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="what the trainers hold (fp32 is cast into the buckets)")
    q.add_argument("--bucket-mb", type=_int(1, 1 << 16, what=" (MiB per bucket)"), action="append",
                   help="repeatable: the bucket sizes to try (default: 256 and 1024)")
    q.add_argument("--sweep", type=_counts, metavar="N,N,...",
                   help="also the best time for each of these replica counts (a text plot)")
    q.add_argument("--plot", type=_out_file, metavar="FILE", help="--sweep: draw it into this SVG file")
    q.add_argument("--json", type=_out_file, metavar="FILE",
                   help="write every backend's prediction as JSON: GB per sender, per rollout GPU and per "
                        "link, the parts of the time, the floor, the memory (and the sweep)")
    q.set_defaults(fn=_plan, parser=q)


def _model(text: str) -> str:
    from weightbus.errors import PlanError
    from weightbus.planning.planner import check_model
    try:
        return check_model(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _counts(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"got {text!r}, need replica counts >= 1 separated by commas, "
                                         f"e.g. 1,2,4")
    return out


def _plan(args: argparse.Namespace) -> int:
    import torch

    from weightbus.errors import PlanError
    from weightbus.planning.cluster import Layout, cluster
    from weightbus.planning.planner import Question, answer, as_json, sweep_all, sweep_svg, sweep_text, table

    if args.plot and not args.sweep:
        args.parser.error("--plot draws the --sweep: give --sweep N,N,... too")
    if args.verify_every != 1 and args.delta is None:
        args.parser.error("--verify-every sets the delta updates' check: give --delta too")
    if args.senders is not None and args.senders > args.trainers:
        args.parser.error(f"--senders {args.senders}: more than the {args.trainers} trainer GPUs "
                          f"(--trainers); give at most {args.trainers}")
    group = args.tp * args.pp * args.ep
    if group > 1 and args.trainers % group:
        args.parser.error(f"--tp {args.tp} --pp {args.pp} --ep {args.ep}: {args.trainers} trainer GPUs "
                          f"(--trainers) are no whole number of Megatron replicas of {group}; give a "
                          f"multiple of {group}")
    if group > 1 and args.senders is not None:
        args.parser.error(f"--senders {args.senders}: under Megatron (--tp/--pp/--ep) one data-parallel "
                          f"replica sends ({group} ranks); drop --senders")
    lay = Layout(args.trainers, args.replicas, args.rollout_gpus, senders=args.senders,
                 colocated=args.colocated, tp=args.tp, pp=args.pp, ep=args.ep)
    c = cluster(args.cluster)
    need = -(-lay.gpus_needed() // c.gpus_per_node)
    if args.nodes is not None and args.nodes < need:
        args.parser.error(f"--nodes {args.nodes}: the layout needs {lay.gpus_needed()} GPUs, "
                          f"{need} nodes of {c.gpus_per_node}; give --nodes {need} or more (or leave it out)")
    c = c.with_nodes(args.nodes or need)
    try:
        lay.check(c)
    except PlanError as e:
        args.parser.error(str(e))
    q = Question(c, lay, args.model, fp8=args.fp8, delta=args.delta, verify_every=args.verify_every,
                 trainer_dtype=torch.float32 if args.trainer_dtype == "fp32" else torch.bfloat16,
                 bucket_sizes=tuple(mb << 20 for mb in (args.bucket_mb or [256, 1024])))
    preds, model = answer(q)
    print(table(q, preds, model))
    every = sweep_all(q, args.sweep) if args.sweep else None
    rows = [(n, preds[0]) for n, preds in every] if every else None
    if every and rows:
        print()
        print(sweep_text(rows))
        if args.plot:
            with open(args.plot, "w") as f:
                f.write(sweep_svg(every, f"{args.model} on {c.name}: seconds per update"))
            print(f"plot: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_json(q, preds, model, rows), f, indent=1)
        print(f"json: {args.json}")
    return 0


INTERRUPTED = 130  # the shell's code for a program ended by SIGINT


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser((named,) if named in COMMANDS else ()).parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:  # (every worker process was ended already: runtime.local.spawn)
        print("weightbus: interrupted", file=sys.stderr, flush=True)
        # an interrupt that lands while an object is half made (an asyncio loop mid-__init__)
        # leaves it to fail in its __del__ at exit: the one line above is all there is to say
        sys.unraisablehook = lambda unraisable: None
        return INTERRUPTED


def entry() -> NoReturn:
    """The ``weightbus`` program: :func:`main`, then its exit code. After Ctrl-C it exits
    once the exit handlers have run (they release what the run made: workers, shared
    memory), without the interpreter's teardown of every module: with torch loaded that
    takes 0.5 s on an idle host and over 5 s on a busy one, not what Ctrl-C asks for."""
    code = main()
    if code == INTERRUPTED:
        atexit._run_exitfuncs()  # (what a normal exit runs first)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
