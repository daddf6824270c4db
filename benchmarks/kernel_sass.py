"""What delta mode's GPU diff (pass one, ``weightbus/engines/delta/gpu_triton.py``) costs in
instructions, without a GPU: the kernel compiled by Triton for a target (default sm_90, H100
and H200), disassembled with the ``cuobjdump`` Triton ships, its SASS counted per program (a
block of ``BLOCK`` elements; the kernel has no loop, so the count is what each warp issues),
next to variants with one of its jobs taken out of the source text: the digest terms, the
snapshot's store, both. From the counts, the time the SMs need to issue them for
``--elements`` (one instruction per clock per scheduler, 4 schedulers per SM) beside the
time HBM needs to read the weights and the snapshot: where the first is near or above the
second, the kernel follows the SM clock, and fewer instructions are what make it faster.
Then pass two (``write``), whose work is its loops' steps (one per set bit of a lane's word):
its SASS in all, its registers, and what each loop issues a step.

    python benchmarks/kernel_sass.py [--arch 90] [--elements 8030000000] [--sms 132]
        [--ghz 1.98] [--tbps 4.8] [--dump DIR]

(A static count: it says how much each job adds, not how long the kernel takes; time the
kernels on a GPU with ``benchmarks/delta_gpu_kernels.py``.)
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (Triton 3.9 warns where it is unset)

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.tools.disasm import get_sass, path_to_cuobjdump  # noqa: E402

from weightbus.engines.delta import gpu  # noqa: E402

KERNELS = Path(gpu.__file__).with_name("gpu_triton.py")
TYPES = {  # the arguments of the diff's two passes (any other: a constexpr)
         "cur_tab": "*i64", "snap_tab": "*i64", "n_tab": "*i64", "start_tab": "*i64", "blk_piece": "*i64",
         "blk_off": "*i64", "counts": "*i32", "scratch": "*u8", "partial": "*i64", "b0": "i32",
         "kind_tab": "*i64", "where_tab": "*i64", "vals_tab": "*i64", "blk_base": "*i64", "words": "*i32"}


def _cut(text: str, start: str, end: str, instead: str = "") -> str:
    """``text`` with the span from ``start`` up to ``end`` replaced (both must be there)."""
    a = text.index(start)
    b = text.index(end, a)
    return text[:a] + instead + text[b:]


def variants(source: str) -> dict[str, str]:
    """The kernels' source as it is, and, where its diff has them, with the digest terms
    and/or the snapshot's store taken out of the diff's block (the digest's partial stored
    as 0)."""
    digest = ("    if NARROW:\n        d = x.to(tl.int32)", "@triton.jit\ndef _terms")
    store = ("    if WHOLE:  # a row with a change", "    tl.store(scratch + b")
    if digest[0] not in source:  # (a pass one without them)
        return {"as is": source}
    no_digest = _cut(source, *digest, "    tl.store(partial + b, 0)\n\n\n")
    return {"as is": source, "no digest": no_digest, "no snapshot store": _cut(source, *store),
            "neither": _cut(no_digest, *store)}


def _module(source: str, where: Path) -> Any:
    path = where / f"k{abs(hash(source))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def count(fn: Any, arch: int, whole: bool, warps: int) -> tuple[int, collections.Counter, str, int]:
    """SASS instructions of a pass of the diff compiled for ``arch`` (bf16 pieces, 16-byte
    aligned), by opcode, the SASS, and the registers a thread uses."""
    const = {"INT": tl.int16, "BLOCK": gpu.BLOCK, "ALIGN": 16, "NARROW": True, "WHOLE": whole}
    names = fn.arg_names
    signature = {n: TYPES.get(n, "constexpr") for n in names}
    src = ASTSource(fn=fn, signature=signature,
                    constexprs={(names.index(n),): v for n, v in const.items() if n in names})
    compiled = triton_compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    sass = get_sass(compiled.asm["cubin"])
    ops: collections.Counter = collections.Counter()
    for line in sass.splitlines():
        if "\t" not in line or ";" not in line:
            continue
        words = line.split("\t", 1)[1].split()
        if words[0].startswith("@"):  # (a predicate)
            words = words[1:]
        ops[words[0].rstrip(";").split(".")[0]] += 1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.check_output([path_to_cuobjdump(), "-res-usage", f.name], text=True)
    return sum(ops.values()), ops, sass, int(re.search(r"REG:(\d+)", usage).group(1))


def loops(sass: str) -> list[int]:
    """The SASS instructions of each loop's body (from its label to the branch back to it)."""
    at: dict[str, int] = {}
    out, n = [], 0
    for line in sass.splitlines():
        label = re.match(r"^(\w+):$", line.strip())
        if label:
            at[label.group(1)] = n
        elif "\t" in line and ";" in line:
            back = re.search(r"\bBRA\s+(\w+);", line)
            if back and back.group(1) in at and at[back.group(1)] < n:  # (not the end's self-branch)
                out.append(n - at[back.group(1)] + 1)
            n += 1
    return out


def resident(regs: int, warps: int) -> int:
    """Warps an SM of compute capability 9.0 keeps resident: 64 at most, 65,536 registers
    (allocated per warp in units of 256), whole programs only."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(64, 65536 // per_warp) // warps * warps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100, H200)")
    ap.add_argument("--elements", type=float, default=8.03e9, help="bf16 elements diffed (8b: 8.03e9)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--ghz", type=float, default=1.98, help="SM clock")
    ap.add_argument("--tbps", type=float, default=4.8, help="HBM bandwidth (H200: 4.8, H100: 3.35)")
    ap.add_argument("--warps", type=int, default=gpu.WARPS[0])
    ap.add_argument("--dump", help="write each variant's SASS into this folder")
    args = ap.parse_args()
    programs = args.elements / gpu.BLOCK
    read_ms = 2 * 2 * args.elements / (args.tbps * 1e12) * 1e3  # (weights and snapshot, 2 bytes each)
    print(f"diff (pass one) of {args.elements:.3g} bf16 elements, BLOCK {gpu.BLOCK}, {args.warps} warps, "
          f"sm_{args.arch}; reading the weights and the snapshot: {read_ms:.1f} ms at {args.tbps} TB/s")
    print(f"{'variant':<20}{'SASS/program':>13}{'per element':>12}{'issue ms':>10}{'regs':>6}{'warps/SM':>9}"
          f"  most used")
    with tempfile.TemporaryDirectory() as tmp:
        for name, source in variants(KERNELS.read_text()).items():
            fn = _module(source, Path(tmp)).diff
            n, ops, sass, regs = count(fn, args.arch, True, args.warps)
            issue_ms = programs * args.warps * n / (args.sms * 4 * args.ghz * 1e9) * 1e3
            top = ", ".join(f"{k} {v}" for k, v in ops.most_common(6))
            print(f"{name:<20}{n:>13}{n * 32 * args.warps / gpu.BLOCK:>12.2f}{issue_ms:>10.1f}{regs:>6}"
                  f"{resident(regs, args.warps):>9}  {top}")
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                (Path(args.dump) / f"diff_{name.replace(' ', '_')}.sass").write_text(sass)
    print("per element: SASS lanes per element (a warp's instruction is 32 lanes); issue ms: every "
          "warp's instructions at one per clock per scheduler (a bound below the real time); warps/SM: "
          "resident by registers (of 64)")
    with tempfile.TemporaryDirectory() as tmp:  # pass two: its work is its loops' steps, per set bit
        n, _, sass, regs = count(_module(KERNELS.read_text(), Path(tmp)).write, args.arch, True, gpu.WARPS[1])
    print(f"write (pass two), {gpu.WARPS[1]} warps: {n} SASS in all, {regs} registers; its loops (a step "
          f"per set bit of a lane's 32-bit word: ~4 steps a block at 2 % changed): "
          f"{', '.join(str(x) for x in loops(sass))} SASS a step")


if __name__ == "__main__":
    sys.exit(main())
