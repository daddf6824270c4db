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

say_cases() {  # FILE KEY...: each case of a GPU-case runner's JSON lines, ok or FAILED, its KEY
  # fields, and a failed one's trace
  [ -f "$1" ] || return 0
  python3 - "$@" <<'PY'
import json, sys
keys = sys.argv[2:]
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["case"], "ok" if r.get("ok") else "FAILED", {k: r[k] for k in r if k in keys})
    if not r.get("ok"):
        print((r.get("trace") or r.get("tail") or "")[-2500:])
PY
}
