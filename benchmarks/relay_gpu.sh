#!/usr/bin/env bash
# Relay of shards between replicas (issue 54) and sharded receive (issue 52) on one 4-GPU
# device run: one trainer GPU, the other 3 the rollout. Usage (repo root, on the GPU machine):
#   bash benchmarks/relay_gpu.sh [rows...]       default: tests, then every row below
# Each row is one `weightbus bench` (broadcast, sharded direct and, with --relay, relayed,
# each with its floor) with its own time limit; lines and JSON under $OUT. The planner's
# predictions beside them: python benchmarks/relay_table.py $OUT/*.json (any machine).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONPATH=$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-results}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1
row() {  # row NAME LIMIT_S bench-args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python -m weightbus.tools.cli bench --json "$OUT/$name.json" --scenario disaggregated \
    --trainer-dtype bf16 --iters 3 "$@" > "$OUT/$name.log" 2>&1 || echo "$name: exit $?"
  grep -E "^disagg|^  (sharded|relayed)" "$OUT/$name.log" | awk '!seen[$0]++' | sed "s/^/$name: /"
}
for r in ${@:-tests r8x1 r8x2 r8x3 r8x3t r30x1 r30x3 s8tp3 s30tp3}; do case $r in
  tests) timeout 200 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k "sharded_nccl" 2>&1 \
           | tail -3 ;;
  # one trainer -> 1, 2, 3 replicas of one GPU each: broadcast, direct, chain (a tree: r8x3t)
  r8x1)  row r8x1  90 --preset 8b --rollout-tp 1 --replicas 1 --relay 1 ;;
  r8x2)  row r8x2  90 --preset 8b --rollout-tp 1 --replicas 2 --relay 1 ;;
  r8x3)  row r8x3  100 --preset 8b --rollout-tp 1 --replicas 3 --relay 1 ;;
  r8x3t) row r8x3t 100 --preset 8b --rollout-tp 1 --replicas 3 --relay 2 ;;
  # the many-tensor model (MoE, 12 layers: 3 copies of it fit each rollout GPU)
  r30x1) row r30x1 120 --preset 30b-a3b --layers 12 --rollout-tp 1 --replicas 1 --relay 1 ;;
  r30x3) row r30x3 150 --preset 30b-a3b --layers 12 --rollout-tp 1 --replicas 3 --relay 1 ;;
  # one trainer -> the 3 TP ranks of one replica (issue 52's s30 row, and 8b)
  s8tp3)  row s8tp3  100 --preset 8b --rollout-tp 3 ;;
  s30tp3) row s30tp3 150 --preset 30b-a3b --layers 24 --rollout-tp 3 ;;
esac; done
