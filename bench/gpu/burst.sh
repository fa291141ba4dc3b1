#!/usr/bin/env bash
# A burst of image requests, engine only: vlm-serve's engine against mlx-vlm's
# batch_generate on the same random-weight model (one 896x896 image + ~64 words in,
# greedy, $MAX_TOKENS out, $REQUESTS at once). Results (JSON) go to $OUT.
#   OUT=DIR [WORKER_PARTS=1] bash bench/gpu/burst.sh [preset]        (default gemma3-4b)
# WORKER_PARTS=1: vlm-serve's result also says where its worker's time went
# (bench/burst.py --worker-parts).
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu-burst}
REQUESTS=${REQUESTS:-64}
MAX_TOKENS=${MAX_TOKENS:-256}
MODEL=/tmp/vlm-bench-$PRESET
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"
for engine in vlm-serve mlx-vlm; do
  parts=()
  [ "$engine" = vlm-serve ] && [ -n "${WORKER_PARTS:-}" ] && parts=(--worker-parts)
  python3 bench/burst.py --model "$MODEL" --engine $engine --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
      "${parts[@]}" --result-json "$OUT/burst-$engine.json" > "$OUT/burst-$engine.log" 2>&1
  tail -12 "$OUT/burst-$engine.log"
done
