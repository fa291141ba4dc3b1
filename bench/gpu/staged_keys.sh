#!/usr/bin/env bash
# Decode attention with each warp's keys staged in shared memory
# (VLM_SERVE_ATTENTION_STAGED_KEYS=1) against keys read lane by lane: their bits
# (tests/test_cuda_attention.py: staged against lane by lane, close to MLX's attention,
# a row batched as alone) and 34 layers' time at 64 and 128 rows of the Gemma-3-4B
# shape (bench/attention_kernels.py), the two alternating. Results in $OUT.
#   OUT=DIR bash bench/gpu/staged_keys.sh
set -uo pipefail
OUT=${OUT:-bench/results/gpu-staged-keys}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
timeout -s INT "${LIMIT:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda_attention.py \
    -k "staged or batched_equals or test_matches_mlx" > "$OUT/tests.txt" 2>&1
tail -3 "$OUT/tests.txt"
for staged in 0 1 0 1; do
  echo "== staged keys: $staged"
  VLM_SERVE_ATTENTION_STAGED_KEYS=$staged python3 bench/attention_kernels.py --batch-sizes 64,128 2>&1 | tail -2
done | tee "$OUT/timing.txt"
