#!/usr/bin/env bash
# One device run for the Megatron-core source on a GPU (the hybrid case: a Megatron trainer
# and a Hugging Face rollout on one GPU, weights through CUDA IPC). The device image has no
# megatron-core or mbridge: carry their wheels (no dependencies fetched) in .whl/mg:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 megatron-core==0.16.1 mbridge==0.15.1 einops \
#     transformers==4.57.6 'huggingface-hub<1.0' -d .whl/mg   (+ tokenizers 0.22, manylinux_2_17)
# Usage (repo root, on the GPU machine): bash benchmarks/megatron_gpu.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-results}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -m pip install -q --no-deps --no-index .whl/mg/*.whl 2>&1 | grep -v "root. user" | tail -3
python -c "import torch, megatron.core, mbridge, transformers; print('torch', torch.__version__, 'megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)" 2>&1 | grep -v -i warn
timeout 400 python -m pytest -q -p no:cacheprovider -rs tests/test_megatron.py -k gpu 2>&1 \
  | grep -v -i "warn" | tee "$OUT/megatron_gpu.log" | tail -30
