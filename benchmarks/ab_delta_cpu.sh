#!/usr/bin/env bash
# A/B of delta updates on this host (CPU, gloo): the broadcast and sharded delta rows of
# `weightbus bench` from several checkouts, alternating (older ones under _old/<commit>:
# git archive <commit> weightbus | tar -x -C _old/<commit>), e.g.
#   SIDES="a6b4cf3 new a6b4cf3 new a6b4cf3 new" bash benchmarks/ab_delta_cpu.sh
# 20k: 20,000 tensors of 4 KiB (the walk over pieces shows); 06b: 0.6b, 2 layers (24 tensors);
# d100k: 100,000 x 1 KiB, dense only (issue 52's row: <= 2x of a raw broadcast);
# f20k: the 20k row from 2 FSDP2 trainer ranks (DTensors: each diffs its own rows) to one rollout
# (a side whose bench refuses --trainers with --delta: run it as _old/<commit>_bench, its tree
# with today's weightbus/tools/bench.py).
set -uo pipefail
PY=${PY:-$PWD/.venv/bin/python}
for row in ${ROWS:-20k 06b}; do
  case $row in
    20k) args="--scenario disaggregated --tensors 20000 --tensor-bytes 4096 --trainer-dtype bf16 --rollout-tp 2 --delta 0.02" ;;
    06b) args="--scenario disaggregated --preset 0.6b --layers 2 --trainer-dtype bf16 --rollout-tp 2 --delta 0.02" ;;
    d100k) args="--scenario disaggregated --tensors 100000 --tensor-bytes 1024 --trainer-dtype bf16 --iters 5" ;;
    f20k) args="--scenario disaggregated --tensors 20000 --tensor-bytes 4096 --trainer-dtype bf16 --trainers 2 --delta 0.02" ;;
  esac
  for side in ${SIDES:-old new old new}; do
    dir=$PWD; [ "$side" = new ] || dir=$PWD/_old/$side
    echo "== $row $side"
    (cd "$dir" && PYTHONPATH=$dir timeout 300 "$PY" -m weightbus bench $args 2>&1 | grep -A4 "^scenario" | head -5)
  done
done
