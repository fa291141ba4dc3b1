#!/usr/bin/env bash
# Multi-turn image chat TTFT on a GPU: the same conversations against a server with the
# prefix cache on (warm) and off (cold). Results (JSON) go to $OUT.
#   bash bench/gpu/multiturn.sh [preset]        (default gemma3-4b)
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu-multiturn}
MODEL=/tmp/vlm-bench-$PRESET
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"
for mode in warm cold; do
  extra=""; [ "$mode" = cold ] && extra="--prefix-cache-size 0"
  python3 -m vlm_serve.cli --model "$MODEL" --port 8131 --log-level warning --no-access-log $extra \
    > "$OUT/server-$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:8131/health >/dev/null && break; sleep 0.5; done
  python3 bench/multiturn.py --base-url http://127.0.0.1:8131/v1 --turns 5 --conversations 4 \
    --image-size 896 --max-tokens 32 --result-json "$OUT/$mode.json"
  kill -TERM $pid; wait $pid
done
