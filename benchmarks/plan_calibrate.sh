#!/usr/bin/env bash
# The planner's calibration rows (tests/test_simulate.py), measured again with the code of
# this checkout on one 2-GPU device run (the s*tp3 rows: 4 GPUs). Usage (repo root, on the
# GPU machine):
#   bash benchmarks/plan_calibrate.sh [rows...]     default: every 2-GPU row below
# Prints one line per row (the bench's own summary line) and writes $OUT/<row>.json.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-results}; mkdir -p "$OUT"
args() { case $1 in
  d06)   echo "--scenario disaggregated --preset 0.6b --trainer-dtype bf16" ;;
  d8)    echo "--scenario disaggregated --preset 8b --trainer-dtype bf16" ;;
  d8f)   echo "--scenario disaggregated --preset 8b --trainer-dtype fp32" ;;
  d8delta) echo "--scenario disaggregated --preset 8b --trainer-dtype bf16 --delta 0.02" ;;
  d30)   echo "--scenario disaggregated --preset 30b-a3b --trainer-dtype bf16" ;;
  c8f)   echo "--scenario colocated --preset 8b --trainer-dtype fp32" ;;
  cd8f)  echo "--scenario colocated-direct --preset 8b --trainer-dtype fp32" ;;
  cd30)  echo "--scenario colocated-direct --preset 30b-a3b --layers 24 --trainer-dtype bf16" ;;
  c30)   echo "--scenario colocated --preset 30b-a3b --layers 24 --trainer-dtype bf16" ;;
  h8)    echo "--scenario hybrid-fsdp --preset 8b --trainer-dtype fp32" ;;
  hd8)   echo "--scenario hybrid-fsdp-direct --preset 8b --trainer-dtype fp32" ;;
  hd30)  echo "--scenario hybrid-fsdp-direct --preset 30b-a3b --layers 12 --trainer-dtype fp32" ;;
  # 4 GPUs: one trainer -> the 3 TP ranks of one replica, broadcast and sharded in one run
  s8tp3)  echo "--scenario disaggregated --preset 8b --trainer-dtype bf16 --rollout-tp 3" ;;
  s30tp3) echo "--scenario disaggregated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --rollout-tp 3" ;;
esac; }
nvidia-smi --query-gpu=name --format=csv,noheader | head -1
for r in ${@:-d06 d8 d8f d8delta d30 c8f cd8f cd30 c30 h8 hd8 hd30}; do
  line=$(timeout 170 python -m weightbus.tools.cli bench $(args "$r") --iters 3 --json "$OUT/$r.json" 2>&1 \
    | grep -E "^(colocated|disagg|hybrid|delta|  )" | tail -3 | tr '\n' ' ')
  echo "$r: $line"
done
