#!/usr/bin/env bash
# One device run: GPU tests, then `weightbus bench`. Usage (repo root, on the GPU machine):
#   bash benchmarks/gpu_suite.sh [presets...]        e.g. 0.6b 8b
# Writes logs and bench.json under $OUT (or ./results).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-results}; mkdir -p "$OUT"
presets=("${@:-8b}")
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 240 python -m pytest -q -x -p no:cacheprovider tests/test_gpu.py tests/test_plan.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
fi
args=(); for p in "${presets[@]}"; do args+=(--preset "$p"); done
timeout "${BENCH_TIMEOUT:-420}" python -m weightbus.tools.cli bench "${args[@]}" --iters "${ITERS:-5}" \
  ${SCENARIOS:-} --json "$OUT/bench.json" 2>&1 | grep -v Warning | tee "$OUT/bench.log" | tail -25
# optional bucket-size sweep of one scenario: SWEEP="256 512" SWEEP_SCENARIO=disaggregated
for mb in ${SWEEP:-}; do
  timeout 200 python -m weightbus.tools.cli bench --preset "${presets[-1]}" --scenario "${SWEEP_SCENARIO:-disaggregated}" \
    --bucket-mb "$mb" --iters 3 --json "$OUT/sweep_$mb.json" 2>&1 | grep -v Warning | tail -1
done
