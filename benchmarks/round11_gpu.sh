#!/usr/bin/env bash
# Issues 52 and 54, round eleven: where a delta update's time goes end to end on 2 GPUs.
#   STEPS=timeline bash benchmarks/round11_gpu.sh      (2 GPUs)
# timeline: 8b, 2% changed, 1 trainer GPU -> 1 rollout GPU over NCCL (weightbus bench --delta
#           0.02), every rank's steps recorded (benchmarks/timeline/sitecustomize.py) and lined
#           up (benchmarks/timeline_report.py);
# BENCH_ARGS: more arguments of the ab step's bench (--layers 24 for 30b-a3b);
# ab:       the same row unrecorded, alternating with the last landed commit (its tree under
#           _old/<commit>: git archive <commit> weightbus | tar -x -C _old/<commit>; carry it);
# deltatests: the GPU cases of delta mode (TREE=<side>: of a tree under _old/<side> with its
#           tests: git archive <branch> weightbus tests pyproject.toml | tar -x -C _old/<side>).
# Round twelve's branch lean-diff (pass one without the digest terms; measured slower, not merged):
#   mkdir -p _old/lean && git archive lean-diff weightbus tests pyproject.toml | tar -x -C _old/lean   (carry it)
#   TREE=lean STEPS="deltatests ab" SIDES="new lean new lean" ITERS=8 bash benchmarks/round11_gpu.sh
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
PRESET=${PRESET:-8b}
SIDES=${SIDES:-"764746d new 764746d new"}
at() { if [ "$1" = new ]; then echo "$PWD"; else echo "$PWD/_old/$1"; fi; }
for step in ${STEPS:-timeline}; do
  case $step in
    timeline) rm -rf /tmp/wbtl
      WEIGHTBUS_TIMELINE=/tmp/wbtl PYTHONPATH=$PWD:$PWD/benchmarks/timeline timeout 280 python -m weightbus bench \
        --scenario disaggregated --preset $PRESET --trainer-dtype bf16 --delta 0.02 --iters ${ITERS:-4} 2>&1 \
        | grep -E "delta|disaggregated|timeline|Error" | grep -v "^frame #" | head -6
      python benchmarks/timeline_report.py /tmp/wbtl --last 2 --events | head -${LINES_MAX:-400}
      [ -n "${OUT:-}" ] && cp -r /tmp/wbtl "$OUT/timeline_$PRESET" ;;
    ab) for side in $SIDES; do echo "--- $side"
          PYTHONPATH=$(at "$side") timeout 280 python -m weightbus bench --scenario disaggregated --preset $PRESET \
            --trainer-dtype bf16 --delta 0.02 --iters ${ITERS:-6} ${BENCH_ARGS:-} 2>&1 | grep -E "^  delta|^disaggregated|Error" | grep -v "^frame #" | head -4
        done ;;
    deltatests) (cd "$(at "${TREE:-new}")" && PYTHONPATH=$PWD timeout 420 python -m pytest -q -p no:cacheprovider \
                  tests/test_gpu.py tests/test_delta.py tests/test_sharded.py -k "delta or table or cuda or digest" \
                  2>&1 | tail -4) ;;
  esac
done
