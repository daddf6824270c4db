#!/usr/bin/env bash
# A/B of the hot path on one device run: the same bench rows from several checkouts,
# alternating, so host-to-host variance (the per-tensor launch cost differs ~2x between
# hosts) cancels. Older checkouts go under _old/<name>/ (ignored by git), e.g.
#   for c in 26ec49a 0353599; do mkdir -p _old/$c && git archive $c weightbus | tar -x -C _old/$c; done
#   ROWS="cd30 c30" SIDES="26ec49a 0353599 new 26ec49a 0353599 new" bash benchmarks/ab_hotpath.sh
# ("new" is this checkout; a side named old reads _old/weightbus, as before; a side may add
# one environment setting: new@WEIGHTBUS_DEVICE_COPY=0).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}; mkdir -p "$OUT"
ROWS=${ROWS:-"cd30 d30"}
args() { case $1 in
  cd30)  echo "--scenario colocated-direct --preset 30b-a3b --layers 24 --trainer-dtype bf16 --iters 5" ;;
  cd30f) echo "--scenario colocated-direct --preset 30b-a3b --layers 24 --trainer-dtype fp32 --iters 5" ;;
  c30)   echo "--scenario colocated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --iters 5" ;;
  c30f)  echo "--scenario colocated --preset 30b-a3b --layers 24 --trainer-dtype fp32 --iters 5" ;;
  # the same into a rollout serving block fp8 (the trainer quantizes on the way)
  cd30q) echo "--scenario colocated-direct --preset 30b-a3b --layers 24 --trainer-dtype bf16 --fp8 --iters 5" ;;
  c30q)  echo "--scenario colocated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --fp8 --iters 5" ;;
  d30)   echo "--scenario disaggregated --preset 30b-a3b --trainer-dtype bf16 --iters 3" ;;
  h8)    echo "--scenario hybrid-fsdp-direct --preset 8b --iters 3" ;;
  h30)   echo "--scenario hybrid-fsdp-direct --preset 30b-a3b --layers 12 --iters 3" ;;
  d100k) echo "--scenario disaggregated --tensors 100000 --tensor-bytes 1024 --trainer-dtype bf16 --iters 5" ;;
  # sharded receive, 4 GPUs: one trainer -> the 3 TP ranks of one replica (the sharded line)
  s30)   echo "--scenario disaggregated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --rollout-tp 3 --iters 3" ;;
  # the same at TP=2 (3 GPUs), and the dense 8b at TP=2
  s30tp2) echo "--scenario disaggregated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --rollout-tp 2 --iters 3" ;;
  s8tp2) echo "--scenario disaggregated --preset 8b --trainer-dtype bf16 --rollout-tp 2 --iters 3" ;;
  # two FSDP2 trainer ranks, each holding half of every tensor -> the 2 TP ranks (4 GPUs), and
  # three -> the 3 TP ranks (6 GPUs)
  s30t2) echo "--scenario disaggregated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --rollout-tp 2 --trainers 2 --iters 3" ;;
  s8t2)  echo "--scenario disaggregated --preset 8b --trainer-dtype bf16 --rollout-tp 2 --trainers 2 --iters 3" ;;
  s30t3) echo "--scenario disaggregated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --rollout-tp 3 --trainers 3 --iters 3" ;;
esac; }
for r in $ROWS; do
  for side in ${SIDES:-old new old new}; do
    # (a side may name one environment setting after an @: new@WEIGHTBUS_DEVICE_COPY=0)
    tree=${side%%@*}; setting=; [[ $side == *@* ]] && setting=${side#*@}
    case $tree in new) dir=$PWD ;; old) dir=$PWD/_old ;; *) dir=$PWD/_old/$tree ;; esac
    line=$(cd "$dir" && env $setting PYTHONPATH=$dir timeout 150 python -m weightbus bench $(args $r) 2>&1 \
      | grep -E "^(colocated|disagg|hybrid|  sharded)" | tail -2 | tr -s ' ' | tr '\n' ' ')
    echo "$r $side: $line"
  done
done
