# Sourced by the GPU round scripts (benchmarks/round*_gpu.sh): the device's NCCL settings,
# the GPUs it has, and the pointer extension built before any timed row (a process takes
# Python's pass until it is).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PYTHONPATH=$PWD python -c "
import time; from weightbus.packing import native; t = time.time(); lib = native.pointer_library(wait=True)
print('pointer extension:', 'built' if lib else 'NOT BUILT', f'in {time.time() - t:.1f} s')"
