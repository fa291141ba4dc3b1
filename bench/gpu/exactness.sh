#!/usr/bin/env bash
# Whether a row gets the same tokens batched as alone on this GPU, and which operation of a
# decode step gives it other bits: bench/decode_step.py --check (8 ragged rows, the engine
# step batched against each row alone) and bench/batch_invariance.py, on the tiny float32
# Gemma 3 fixture and the Gemma-3-4B shape (bf16).
#   OUT=DIR bash bench/gpu/exactness.sh
set -uo pipefail
OUT=${OUT:-bench/results/gpu-exactness}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
TINY=/tmp/tiny-gemma3 BIG=/tmp/vlm-bench-gemma3-4b
[ -f $TINY/config.json ] || python3 -m fixtures.build --arch gemma3 --out $TINY > /dev/null 2>&1
[ -f $BIG/config.json ] || python3 -m fixtures.build --arch gemma3 --preset gemma3-4b --out $BIG > /dev/null 2>&1
for flags in "--engine-alone" "--engine-alone --eager"; do
  echo "== tiny, check $flags"
  python3 bench/decode_step.py --model $TINY --check 8 $flags 2>&1 | tail -1
done
for model in $TINY $BIG; do
  echo "== $(basename $model): each operation batched against alone"
  python3 bench/batch_invariance.py --model $model --rows 1,2,8,64,128 2>&1 | tee "$OUT/$(basename $model).txt" | grep -v '^{'
done
