#!/usr/bin/env bash
# Issue 52, round three: the host's pointer passes in C++ and quantization replayed, A/B on
# one GPU (an H200 holds cd30f's fp32 model beside its bf16 copy; an H100 does not):
#   STEPS="cd30 c30 cd30f quant profile" SIDES="503f8e8 c307cfa new" bash benchmarks/round3_gpu.sh
# Older trees under _old/<commit>/ (see ab_hotpath.sh), carried to the device.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
SIDES=${SIDES:-"c307cfa new c307cfa new c307cfa new"}
for step in ${STEPS:-cd30 c30 cd30f quant}; do
  case $step in
    quant)  # block fp8 of 30b-a3b's served weights, 24 layers; five runs of each side
      for side in $SIDES; do
        dir=$PWD; [ "$side" != new ] && dir=$PWD/_old/$side
        PYTHONPATH=$dir timeout 200 python benchmarks/quant_fp8.py --preset 30b-a3b --layers 24 --iters 5 \
          2>&1 | grep -E "^30b" | sed "s/^/quant $side: /"
      done ;;
    profile)  # where the time goes: fp8 per iteration and its kernels; cd30's host, by function;
      # the copy kernel against one bulk copy
      export PYTHONPATH=$PWD
      python benchmarks/quant_fp8.py --preset 30b-a3b --layers 24 --iters 10 --each 2>&1 | grep -E "^30b|^  "
      timeout 200 python benchmarks/profile_update.py --backend colocated --direct --preset 30b-a3b \
        --layers 24 --top 18 2>&1 | grep -vi warning
      timeout 200 python benchmarks/copy_kernels.py --preset 30b-a3b --layers 24 2>&1 | grep -vi warning ;;
    *) ROWS=$step SIDES=$SIDES bash benchmarks/ab_hotpath.sh ;;
  esac
done
