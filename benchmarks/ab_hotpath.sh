#!/usr/bin/env bash
# A/B of the hot path on one device run: the same bench rows from two checkouts, alternating,
# so host-to-host variance (the per-tensor launch cost differs ~2x between hosts) cancels.
#   mkdir _old && git archive <commit> weightbus | tar -x -C _old; ROWS="cd30 d30" bash benchmarks/ab_hotpath.sh
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}; mkdir -p "$OUT"
ROWS=${ROWS:-"cd30 d30"}
args() { case $1 in
  cd30) echo "--scenario colocated-direct --preset 30b-a3b --layers 24 --trainer-dtype bf16 --iters 5" ;;
  c30)  echo "--scenario colocated --preset 30b-a3b --layers 24 --trainer-dtype bf16 --iters 5" ;;
  d30)  echo "--scenario disaggregated --preset 30b-a3b --trainer-dtype bf16 --iters 3" ;;
  h8)   echo "--scenario hybrid-fsdp-direct --preset 8b --iters 3" ;;
  h30)  echo "--scenario hybrid-fsdp-direct --preset 30b-a3b --layers 12 --iters 3" ;;
  d100k) echo "--scenario disaggregated --tensors 100000 --tensor-bytes 1024 --trainer-dtype bf16 --iters 5" ;;
esac; }
for r in $ROWS; do
  for side in ${SIDES:-old new old new}; do
    dir=$PWD; [ $side = old ] && dir=$PWD/_old
    line=$(cd "$dir" && PYTHONPATH=$dir timeout 150 python -m weightbus.cli bench $(args $r) 2>&1 \
      | grep -E "^(colocated|disaggregated|hybrid)" | tail -1)
    echo "$r $side: $line"
  done
done
