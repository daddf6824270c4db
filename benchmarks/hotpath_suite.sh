#!/usr/bin/env bash
# The packing hot path on GPUs (issue: link speed at MoE scale). One device run on 2 GPUs:
#   bash benchmarks/hotpath_suite.sh            (repo root; logs and JSON under $OUT)
# GPU tests first (the engines' CUDA paths), then each bench row with its own time limit.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-results}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_plan.py 2>&1 | tail -4
fi
row() {  # row NAME LIMIT_S bench-args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python -m weightbus.tools.cli bench --json "$OUT/$name.json" "$@" 2>&1 \
    | grep -v Warning | tee "$OUT/$name.log" | grep -E "^\[|^(colocated|disaggregated|hybrid)" | tail -3
}
ROWS=${ROWS:-"d8 d30 cd30 c30 h8 d30f cd30f"}
for r in $ROWS; do case $r in
  d8)    row d8    90  --scenario disaggregated --preset 8b --trainer-dtype bf16 --iters 3 ;;
  d30)   row d30   150 --scenario disaggregated --preset 30b-a3b --trainer-dtype bf16 --iters 3 ;;
  cd30)  row cd30  90  --scenario colocated-direct --preset 30b-a3b --layers 24 --trainer-dtype bf16 --iters 3 ;;
  c30)   row c30   90  --scenario colocated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --iters 3 ;;
  h8)    row h8    90  --scenario hybrid-fsdp-direct --preset 8b --iters 3 ;;
  d30f)  row d30f  150 --scenario disaggregated --preset 30b-a3b --trainer-dtype fp32 --iters 2 ;;
  cd30f) row cd30f 90  --scenario colocated-direct --preset 30b-a3b --layers 24 --trainer-dtype fp32 --iters 3 ;;
esac; done
