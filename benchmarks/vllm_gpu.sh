#!/usr/bin/env bash
# vLLM on the GPU machine, one command per vLLM install. vLLM's wheels travel as
# ../shared/vllm_gpu/README.md says (installed with SITE=/tmp/siteNN); this project's own
# wheel (`pip wheel --no-deps -w .wbwheel .`, carried in .wbwheel/) gives vLLM's workers
# weightbus's vllm.general_plugins entry point.
#
#   SITE=/tmp/site26 bash benchmarks/vllm_gpu.sh tests   # compat (README snippet) + GPU cases
#   SITE=/tmp/site32 bash benchmarks/vllm_gpu.sh speed   # weightbus vs vLLM's own engines
#
# Each piece runs in its own process group, ended by its id after it (a leaked engine
# keeps its GPU memory). Logs and JSON rows go to $OUT (or ./results).
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
WB=/tmp/wb_$(basename "$SITE")
if [ ! -d "$WB/weightbus" ]; then
  whl=$(ls .wbwheel/weightbus-*.whl 2>/dev/null | head -1)
  if [ -n "$whl" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WB" "$whl" || exit 1
  else
    PYTHONPATH=$SITE python3 -m pip install -q --no-deps --no-build-isolation --target "$WB" . || exit 1
  fi
fi
export PYTHONPATH=$PWD:$WB:$SITE PYTHONUNBUFFERED=1
export VLLM_USE_FLASHINFER_SAMPLER=0 PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1
. "$(dirname "$0")/engine_lib.sh"   # run(), say_versions(), say_cases(), no multicast
v=$(say_versions vLLM vllm) || exit 1

case "${1:-tests}" in
tests)
  [ "${COMPAT:-1}" = 1 ] && run "${COMPAT_S:-170}" python3 -m pytest -q -p no:cacheprovider -x tests/test_vllm_compat.py \
    > "$OUT/compat_$v.log" 2>&1 && tail -3 "$OUT/compat_$v.log"
  WB_VLLM_RESULTS=$OUT/gpu_cases_$v.jsonl WB_VLLM_CASE_TIMEOUT=${CASE_S:-100} \
    run "${CASES_S:-420}" python3 -m pytest -q -p no:cacheprovider -rA tests/test_vllm_gpu.py -k "${CASES:-}" \
    > "$OUT/gpu_cases_$v.log" 2>&1
  grep -E "passed|failed|PASSED|FAILED|SKIPPED|Error" "$OUT/gpu_cases_$v.log" | tail -12
  say_cases "$OUT/gpu_cases_$v.jsonl" engine_start_s updates checked
  ;;
speed)
  specs=("8b 24 colocated" "30b-a3b 12 colocated" "8b 24 nccl" "30b-a3b 12 nccl")
  [ -n "${SPECS:-}" ] && IFS=, read -ra specs <<< "$SPECS"   # e.g. SPECS="8b 24 colocated,0.6b 28 nccl"
  for spec in "${specs[@]}"; do
    set -- $spec
    run "${SPEED_S:-150}" python3 benchmarks/vllm_gpu.py --preset "$1" --layers "$2" --mode "$3" \
      --json "$OUT/speed_$v.jsonl" > "$OUT/speed_${v}_$1_$3.log" 2>&1 || echo "($spec: exit $?)"
  done
  python3 benchmarks/vllm_gpu.py --table "$OUT/speed_$v.jsonl"
  ;;
esac
