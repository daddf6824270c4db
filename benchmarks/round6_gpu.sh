#!/usr/bin/env bash
# Issue 52, round six, 4 GPUs: FSDP2 trainer ranks that each send their own rows (no gather),
# A/B against the last landed commit, then where the sharded row's host time goes:
#   STEPS="s30t2 s8t2 prof" SIDES="new f872318 new new" bash benchmarks/round6_gpu.sh
# (older trees under _old/<commit>, carried; rows: benchmarks/ab_hotpath.sh)
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
SIDES=${SIDES:-"new f872318 new new"}
for step in ${STEPS:-s30t2 s8t2 prof}; do
  case $step in
    prof) echo "--- s30t2 sharded, rank 0's host by function (one timed call)"
          WEIGHTBUS_BENCH_PROFILE=sharded PYTHONPATH=$PWD timeout 200 python -m weightbus bench \
            --scenario disaggregated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --rollout-tp 2 \
            --trainers 2 --iters 1 2>&1 | grep -vi warning | tail -45 ;;
    *) ROWS=$step SIDES=$SIDES bash benchmarks/ab_hotpath.sh ;;
  esac
done
