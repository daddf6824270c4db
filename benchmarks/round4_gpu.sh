#!/usr/bin/env bash
# Issue 52, round four, one GPU: where the colocated rows' time goes and the copy kernel's
# shape, then the A/B rows against the last landed commit:
#   STEPS="sweep timeline cd30 c30" SIDES="9546d93 new 9546d93 new" bash benchmarks/round4_gpu.sh
# sweep:    benchmarks/copy_sweep.py (the GPU copy list's chunk, step and warps against one
#           bulk copy, bitwise);
# timeline: one warm update of c30 (the ring) and cd30 (direct) under torch's profiler on each
#           side (GPU busy time, span, top kernels), and cd30's host by function (cProfile);
# others:   rows of benchmarks/ab_hotpath.sh (older trees under _old/<commit>, carried).
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
SIDES=${SIDES:-"9546d93 new 9546d93 new"}
for step in ${STEPS:-sweep timeline cd30 c30}; do
  case $step in
    sweep) PYTHONPATH=$PWD timeout 240 python benchmarks/copy_sweep.py --preset 30b-a3b --layers 24 \
             ${SWEEP:-} 2>&1 | grep -vi warning ;;
    timeline)
      for mode in "" "--direct"; do
        echo "--- colocated ${mode:-ring} 30b-a3b/24L: GPU timeline"
        PYTHONPATH=$PWD timeout 200 python benchmarks/profile_update.py --backend colocated $mode \
          --preset 30b-a3b --layers 24 --timeline 2>&1 | grep -vi warning
      done
      echo "--- colocated ring 30b-a3b/24L: host by function"
      PYTHONPATH=$PWD timeout 200 python benchmarks/profile_update.py --backend colocated \
        --preset 30b-a3b --layers 24 --top 14 2>&1 | grep -vi warning ;;
    *) ROWS=$step SIDES=$SIDES bash benchmarks/ab_hotpath.sh ;;
  esac
done
