#!/usr/bin/env bash
# Delta updates on the device machine (issue 16): the disaggregated scenario over NCCL,
# 2% of the trainer's elements changed per round, a delta-mode engine timed next to the dense
# one in the same run. Usage (repo root, on a 2-GPU machine): bash benchmarks/delta_gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-results}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for run in "8b bf16" "8b fp32" "30b-a3b bf16 --layers 24" ; do
  set -- $run
  timeout "${BENCH_TIMEOUT:-240}" python -m weightbus.tools.cli bench --scenario disaggregated --preset "$1" \
    --trainer-dtype "$2" "${@:3}" --iters "${ITERS:-3}" --delta "${DELTA:-0.02}" \
    --json "$OUT/delta_$1_$2.json" 2>&1 | grep -v Warning | tail -3
done
