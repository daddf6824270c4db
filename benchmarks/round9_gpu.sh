#!/usr/bin/env bash
# Issue 52, round nine, one GPU: the copy list's float32 -> bfloat16 cast in its Triton
# kernel (cd30f: a float32 trainer into a bfloat16 colocated rollout), and the A/B of it
# against the last landed commit (its tree under _old/<commit>: git archive <commit> weightbus
# | tar -x -C _old/<commit>):
#   STEPS="cast tests" bash benchmarks/round9_gpu.sh
#   STEPS="cd30f cd30" SIDES="a6b4cf3 new a6b4cf3 new a6b4cf3 new" bash benchmarks/round9_gpu.sh
# cast:   the kernel's cast over 30b-a3b/24's tensors at each chunk, step and warp count,
#         against one bulk cast and torch's multi-tensor cast (benchmarks/copy_sweep.py);
# tests:  the GPU cases of the copy list, the colocated engine and fp8 (bitwise);
# delta:  a delta update's trainer side (the diff and its records, 4 rounds) and a receiver's
#         apply on 30b-a3b/24 (9,435 tensors), walking the pieces each update and replaying
#         the kernel calls (--table), alternating (benchmarks/delta_profile.py);
# deltatests: the GPU cases of delta mode (the Triton kernels, sharded delta on a GPU);
# others: rows of benchmarks/ab_hotpath.sh.
set -uo pipefail
source "$(dirname "$0")/gpu_prelude.sh"
SIDES=${SIDES:-"a6b4cf3 new a6b4cf3 new"}
M="--preset 30b-a3b --layers 24"
for step in ${STEPS:-cast tests}; do
  case $step in
    cast) PYTHONPATH=$PWD timeout 240 python benchmarks/copy_sweep.py $M --dtype fp32 --chunks 64,128 \
            --blocks 4096,8192 --warps 4,8,16 --iters 5 2>&1 | grep -vi warning ;;
    delta) for t in "" --table "" --table; do echo "--- delta_profile ${t:-(walking the pieces)}"
             PYTHONPATH=$PWD timeout 240 python benchmarks/delta_profile.py $M --device cuda --rounds 4 \
               --split 4 $t 2>&1 | grep -E "^(round|median|arenas|device)"; done ;;
    deltatests) PYTHONPATH=$PWD timeout 420 python -m pytest -q -p no:cacheprovider tests/test_gpu.py \
                  tests/test_delta.py -k "delta or table or cuda" 2>&1 | tail -6 ;;
    tests) PYTHONPATH=$PWD timeout 420 python -m pytest -q -p no:cacheprovider tests/test_device_copy.py \
             tests/test_gpu.py tests/test_quant.py tests/test_hotpath.py -k "copy or colocated or direct or written or gpu or cast" \
             2>&1 | tail -8 ;;
    *) ROWS=$step SIDES=$SIDES bash benchmarks/ab_hotpath.sh ;;
  esac
done
