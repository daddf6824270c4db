#!/usr/bin/env bash
# SGLang on the GPU machine. SGLang's wheels travel as ../shared/sglang_gpu/README.md says
# (installed into $SITE, default /tmp/site); this project is read from the checkout
# (SGLang's workers import weightbus's hook by its dotted name: PYTHONPATH carries it).
#
#   bash benchmarks/sglang_gpu.sh tests            # tests/test_sglang_gpu.py: hybrid, nccl, tp2
#   bash benchmarks/sglang_gpu.sh speed            # weightbus against SGLang's own paths
#   bash benchmarks/sglang_gpu.sh verl             # verl's SGLang rollout through weightbus.nccl
#                                                  # (Ray and verl carried too: VERL_SITE)
#
# Each piece runs in its own process group, ended by its id after it (a leaked engine keeps
# its GPU memory). Logs and JSON rows go to $OUT (or ./results).
set -uo pipefail
OUT=${OUT:-results}; mkdir -p "$OUT"
SITE=${SITE:-/tmp/site}
export PYTHONPATH=$PWD:$PWD/tests:$SITE PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# SGLang sets NCCL_CUMEM_ENABLE=0 in its processes when unset; NCCL peers that differ in it hang
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-0}
. "$(dirname "$0")/engine_lib.sh"   # run(), say_versions(), say_cases(), no multicast
v=$(say_versions SGLang sglang) || exit 1

case "${1:-tests}" in
tests)
  WB_SGLANG_RESULTS=$OUT/sglang_cases_$v.jsonl WB_SGLANG_CASE_TIMEOUT=${CASE_S:-200} \
    run "${CASES_S:-560}" python3 -m pytest -q -p no:cacheprovider -rA tests/test_sglang_gpu.py -k "${CASES:-}" \
    > "$OUT/sglang_cases_$v.log" 2>&1
  grep -E "passed|failed|PASSED|FAILED|SKIPPED" "$OUT/sglang_cases_$v.log" | tail -8
  say_cases "$OUT/sglang_cases_$v.jsonl" engine_start_s updates checked refused error
  ;;
speed)
  specs=("1.7b 28" "8b 36")
  [ -n "${SPECS:-}" ] && IFS=, read -ra specs <<< "$SPECS"   # e.g. SPECS="1.7b 28,8b 36"
  for spec in "${specs[@]}"; do
    set -- $spec
    run "${SPEED_S:-280}" python3 benchmarks/sglang_gpu.py --preset "$1" --layers "$2" \
      --json "$OUT/sglang_speed_$v.jsonl" > "$OUT/sglang_speed_${v}_$1.log" 2>&1 || echo "($spec: exit $?)"
  done
  python3 benchmarks/sglang_gpu.py --table "$OUT/sglang_speed_$v.jsonl"
  ;;
verl)
  run "${VERL_S:-480}" python3 benchmarks/verl_sglang_gpu.py --layers "${LAYERS:-8}" \
    --json "$OUT/verl_sglang_$v.jsonl" > "$OUT/verl_sglang_$v.log" 2>&1 || echo "(verl: exit $?)"
  grep -E '"row"' "$OUT/verl_sglang_$v.log" | cut -c1-400
  grep -E "Error|error|Traceback" "$OUT/verl_sglang_$v.log" | tail -15
  ;;
esac
