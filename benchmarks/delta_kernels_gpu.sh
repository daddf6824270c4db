#!/usr/bin/env bash
# Delta mode's GPU kernels (Triton) on one GPU, no transport: the compiled kernels' tests,
# then where an update's time goes (diff, pack, apply) with the kernels and with the torch
# path, on a dense preset and an MoE one, next to one bulk copy of the same bytes.
# Usage (repo root, on a GPU machine): bash benchmarks/delta_kernels_gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 240 python -m pytest -q -x tests/test_delta.py 2>&1 | tail -3
for run in "8b" "30b-a3b --layers 12"; do
  for kernels in 1 0; do
    echo "== $run, WEIGHTBUS_DELTA_KERNELS=$kernels"
    WEIGHTBUS_DELTA_KERNELS=$kernels timeout 240 python benchmarks/delta_profile.py --preset $run \
      --device cuda --fraction "${DELTA:-0.02}" 2>&1 | grep -v Warning | tail -3
  done
done
