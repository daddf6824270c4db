#!/usr/bin/env bash
# Issue 52, round seven, one GPU: an fp8 update into a colocated rollout, the quantizer
# writing straight into the rollout's weights (QuantizedSource.write_into, direct mode),
# A/B against the last landed commit in one device run. That tree goes under
# _old/<commit> with this checkout's bench tool copied in (its own has no --fp8):
#   mkdir -p _old/cbcf1a2 && git archive cbcf1a2 weightbus | tar -x -C _old/cbcf1a2
#   cp weightbus/tools/bench.py weightbus/tools/cli.py _old/cbcf1a2/weightbus/tools/
#   STEPS="tests cd30q c30q cd30" SIDES="cbcf1a2 new cbcf1a2 new" bash benchmarks/round7_gpu.sh
# tests:   the GPU cases of the path (tests/test_quant.py, tests/test_gpu.py's colocated ones);
# profile: one warm cd30q update per side, host by function (cProfile);
# quant:   the quantizer alone on 30b-a3b's served weights (benchmarks/quant_fp8.py), this
#          checkout against the first of SIDES;
# others:  rows of benchmarks/ab_hotpath.sh.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
SIDES=${SIDES:-"cbcf1a2 new cbcf1a2 new"}
for step in ${STEPS:-tests cd30q c30q cd30}; do
  case $step in
    tests) PYTHONPATH=$PWD timeout 420 python -m pytest -q -p no:cacheprovider tests/test_quant.py \
             tests/test_gpu.py -k "gpu or written or colocated" 2>&1 | tail -6 ;;
    profile)
      for rank in 0 1; do
        PYTHONPATH=$PWD WEIGHTBUS_BENCH_PROFILE=weightbus WEIGHTBUS_BENCH_PROFILE_RANK=$rank timeout 200 \
          python -m weightbus bench --scenario colocated-direct --preset 30b-a3b --layers 24 \
          --trainer-dtype bf16 --fp8 --iters 2 2>&1 | grep -vi warning | head -40
      done ;;
    quant)
      for side in new ${SIDES%% *} new; do  # (this checkout's script, each side's weightbus)
        dir=$PWD; [ "$side" = new ] || dir=$PWD/_old/$side
        PYTHONPATH=$dir timeout 200 python benchmarks/quant_fp8.py --preset 30b-a3b --layers 24 --iters 5 \
          2>&1 | grep -E "^30b" | sed "s/^/quant $side: /"
      done ;;
    *) ROWS=$step SIDES=$SIDES bash benchmarks/ab_hotpath.sh ;;
  esac
done
