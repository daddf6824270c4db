#!/usr/bin/env bash
# Issues 52 and 54, round ten: delta's whole-destination check made cheap (its kernel without
# a multiply per element; read before the update writes, beside the trainer's diff), and the
# A/B against the last landed commit (its tree under _old/<commit>: git archive <commit>
# weightbus | tar -x -C _old/<commit>):
#   STEPS="verify deltatests profile" SIDES="56ee88f new 56ee88f new" bash benchmarks/round10_gpu.sh
#   STEPS=e2e SIDES="56ee88f new 56ee88f new" bash benchmarks/round10_gpu.sh     (2 GPUs)
# verify:     the check alone over 8b, 30b-a3b/24 and 0.6b's tensors against one bulk read
#             (benchmarks/delta_verify_gpu.py), each side;
# deltatests: the GPU cases of delta mode (the Triton kernels, sharded delta on a GPU);
# profile:    where a delta update's time goes on 8b, trainer side and apply, kernels timed
#             (benchmarks/delta_profile.py --table --kernel-times --profile);
# groups:     the same at 2^29 (the engine's), 2^30 and 2^31 elements diffed per launch;
# gc:         30b-a3b/24's trainer side and apply with Python's collector paused (as an engine's update
#             does) and running (--gc), alternating;
# e2e:        delta end to end, 1 trainer GPU -> 1 rollout GPU over NCCL, 8b and 30b-a3b/24,
#             2% changed (weightbus bench --delta 0.02), each side.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
SIDES=${SIDES:-"56ee88f new 56ee88f new"}
at() { if [ "$1" = new ]; then echo "$PWD"; else echo "$PWD/_old/$1"; fi; }
for step in ${STEPS:-verify deltatests}; do
  case $step in
    verify) for side in $SIDES; do echo "--- $side"
              PYTHONPATH=$(at "$side") timeout 200 python benchmarks/delta_verify_gpu.py 2>&1 | grep -v "^|---"; done ;;
    deltatests) PYTHONPATH=$PWD timeout 420 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
                  tests/test_delta.py tests/test_sharded.py -k "delta or table or cuda or digest" 2>&1 | tail -6 ;;
    profile) PYTHONPATH=$PWD timeout 300 python benchmarks/delta_profile.py --preset 8b --device cuda --rounds 4 \
               --split 4 --table --kernel-times --profile 2>&1 | grep -v "^$" | head -60 ;;
    groups) for g in 536870912 1073741824 2147483648 536870912 2147483648; do echo "--- group $g"
              PYTHONPATH=$PWD timeout 200 python benchmarks/delta_profile.py --preset 8b --device cuda --rounds 5 \
                --split 4 --table --group $g 2>&1 | grep -E "^(round [1-9]|median|device)"; done ;;
    gc) for g in "" --gc "" --gc; do echo "--- 30b-a3b/24 ${g:-(collector paused, as an engine)}"
          PYTHONPATH=$PWD timeout 200 python benchmarks/delta_profile.py --preset 30b-a3b --layers 24 --device cuda \
            --rounds 4 --split 4 --table $g 2>&1 | grep -E "^(round [1-9]|median)"; done ;;
    e2e) for side in $SIDES; do for m in "8b" "30b-a3b --layers 24"; do echo "--- $side $m"
           PYTHONPATH=$(at "$side") timeout 280 python -m weightbus bench --scenario disaggregated --preset $m \
             --trainer-dtype bf16 --delta 0.02 --iters 3 2>&1 | grep -E "delta|disaggregated|Error|error" | head -6
         done; done ;;
  esac
done
