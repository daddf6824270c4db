# Sourced by benchmarks/vllm_gpu.sh and benchmarks/sglang_gpu.sh: what every inference-engine
# run on the GPU machine shares.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast

run() {  # seconds, command...: in its own process group, ended by its id afterwards
  local t=$1; shift
  setsid timeout -k 5 "$t" "$@" &
  local pid=$!
  wait "$pid"; local rc=$?
  kill -9 -- "-$pid" 2>/dev/null
  return $rc
}

say_versions() {  # engine name, its python module: the versions and the first GPU, one line each
  local v
  v=$(python3 -c "import $2; print($2.__version__)") || return 1
  echo "$1 $v, $(python3 -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())')" >&2
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | head -1 >&2
  echo "$v"
}
