#!/usr/bin/env bash
# Issue 52, round eight, one GPU: where cd30 (colocated-direct, 30b-a3b/24, bf16) spends
# the time over its copy, and the A/B of what it changes against the last landed commit
# (its tree under _old/<commit>: git archive <commit> weightbus | tar -x -C _old/<commit>):
#   STEPS="phases copy cd30" SIDES="06f17f2 new 06f17f2 new" bash benchmarks/round8_gpu.sh
# phases:   every engine step timed on both sides, one clock, medians of 7 warm updates
#           (benchmarks/profile_update.py --phases), for each tree of SIDES once;
# timeline: one warm update per side under torch's profiler (GPU busy time, span);
# copy:     the copy alone over the same tensors against one bulk copy
#           (benchmarks/copy_kernels.py);
# tests:    the GPU cases of the colocated engine (tests/test_gpu.py, tests/test_quant.py);
# others:   rows of benchmarks/ab_hotpath.sh.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
SIDES=${SIDES:-"06f17f2 new 06f17f2 new"}
M="--preset 30b-a3b --layers 24"
for step in ${STEPS:-phases copy cd30}; do
  case $step in
    phases)
      for side in $(echo $SIDES | tr ' ' '\n' | awk '!seen[$0]++'); do
        dir=$PWD; [ "$side" = new ] || dir=$PWD/_old/$side
        echo "--- phases, $side"
        PYTHONPATH=$dir timeout 200 python benchmarks/profile_update.py --backend colocated --direct $M \
          --phases 7 2>&1 | grep -vi warning
      done ;;
    timeline)
      PYTHONPATH=$PWD timeout 200 python benchmarks/profile_update.py --backend colocated --direct $M \
        --timeline 2>&1 | grep -vi warning ;;
    copy) PYTHONPATH=$PWD timeout 200 python benchmarks/copy_kernels.py $M 2>&1 | grep -vi warning | tail -12 ;;
    tests) PYTHONPATH=$PWD timeout 420 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
             tests/test_quant.py tests/test_hotpath.py -k "colocated or direct or written or gpu" 2>&1 | tail -8 ;;
    *) ROWS=$step SIDES=$SIDES bash benchmarks/ab_hotpath.sh ;;
  esac
done
