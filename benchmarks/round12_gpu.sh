#!/usr/bin/env bash
# Issue 52, round twelve: the lean-diff branch (pass one without the digest terms) against main
# on 2 GPUs. Its tree: mkdir -p _old/lean && git archive lean-diff weightbus tests pyproject.toml |
# tar -x -C _old/lean (carry _old/lean).
#   STEPS="kernels clocks" SIDES="new lean new lean" bash benchmarks/round12_gpu.sh
#   STEPS=rounds bash benchmarks/round12_gpu.sh          (next: how many rounds an update takes)
# kernels: the diff's two passes and the apply alone, timed by CUDA events
#          (benchmarks/delta_gpu_kernels.py), on 2^30 bf16 elements, each side's tree;
# tl:      each side's timeline of 8b delta updates (benchmarks/timeline/, with each delta
#          kernel timed on the GPU and each group's host steps: WEIGHTBUS_TIMELINE_GPU=1);
# rounds:  8b end to end at 2, 3 and 4 rounds an update (ROUNDS="4 2 3 ...": each round costs
#          the trainer ~1 ms of plan and ~0.5-0.9 ms to start the next; fewer rounds, less overlap);
# clocks:  the GPUs' SM and memory clocks, power and temperature now (the 8b delta rows are
#          bimodal: is it the clock?);
# end to end, 8b or 30b-a3b: benchmarks/round11_gpu.sh (STEPS=ab, PRESET=..., SIDES=...).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
SIDES=${SIDES:-"new lean new lean"}
at() { if [ "$1" = new ]; then echo "$PWD"; else echo "$PWD/_old/$1"; fi; }
for step in ${STEPS:-kernels}; do
  case $step in
    kernels) for side in $SIDES; do echo "--- $side"
        PYTHONPATH=$(at "$side") timeout 200 python benchmarks/delta_gpu_kernels.py --elements $((1 << 30)) \
          --fractions 0 0.02 ${KERNEL_ARGS:-} 2>&1 | tail -4
      done ;;
    tl) for side in $SIDES; do echo "--- $side"; rm -rf /tmp/wbtl  # a timeline of each side, GPU kernels timed too
          WEIGHTBUS_TIMELINE=/tmp/wbtl WEIGHTBUS_TIMELINE_GPU=1 PYTHONPATH=$(at "$side"):$PWD/benchmarks/timeline \
            timeout 200 python -m weightbus bench --scenario disaggregated --preset 8b --trainer-dtype bf16 \
            --delta 0.02 --iters ${ITERS:-6} 2>&1 | grep -E "^  delta|Error" | grep -v "^frame #" | head -3
          python benchmarks/timeline_report.py /tmp/wbtl --last 3 | grep -E "^===|trainer"
        done ;;
    rounds) for r in ${ROUNDS:-4 2 3 4 2 3}; do echo "--- WEIGHTBUS_DELTA_ROUNDS=$r"  # rounds an update is sent in
          WEIGHTBUS_DELTA_ROUNDS=$r PYTHONPATH=$PWD timeout 200 python -m weightbus bench --scenario disaggregated \
            --preset 8b --trainer-dtype bf16 --delta 0.02 --iters ${ITERS:-8} 2>&1 | grep -E "^  delta|Error" \
            | grep -v "^frame #" | head -2
        done ;;
    clocks) nvidia-smi --query-gpu=index,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
              --format=csv; nvidia-smi topo -m; lscpu | grep -E "NUMA|^CPU\(s\)|Model name" ;;
  esac
done
