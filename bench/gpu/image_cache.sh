#!/usr/bin/env bash
# The image cache on a GPU machine: per-stage preprocessing of a new and a resent
# 896 px image on its CPU, then multi-turn image chat TTFT (Gemma-3-4B shape) with the
# prefix cache on (warm), off (cold), and every cache off (none), and where each turn's
# time goes server-side. BEFORE=DIR runs the same with the vlm_serve package in DIR
# (a copy from before the image cache) and labels the files "before-".
# IMAGE="--image-format jpeg" changes the chat's image (default: 896 px noise as PNG,
# a 3.2 MB body; bench/multiturn.py's options). MAX_TOKENS: each answer's length (32).
# BREAKDOWN=0 skips the preprocessing profile and the in-process breakdown.
#   OUT=DIR [BEFORE=DIR] [MODES="warm cold none"] [IMAGE=...] [MAX_TOKENS=N] [BREAKDOWN=0] bash bench/gpu/image_cache.sh
set -uo pipefail
OUT=${OUT:-bench/results/gpu-image-cache}
MODES=${MODES:-warm cold none}
MODEL=${MODEL:-/tmp/vlm-bench-gemma3-4b}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch gemma3 --preset gemma3-4b --out "$MODEL"
OUT=$(cd "$OUT" && pwd)
# `python3 -m` and `-c` put the current directory first on sys.path: the server and
# the check run from the directory whose vlm_serve is measured.
label=after SERVE_DIR=$PWD
if [ -n "${BEFORE:-}" ]; then export PYTHONPATH=$BEFORE:$PWD; label=before SERVE_DIR=$BEFORE; fi
(cd "$SERVE_DIR" && python3 -c 'import mlx.core as mx, vlm_serve; print("mlx", mx.__version__, mx.default_device(), vlm_serve.__file__)') | tee "$OUT/$label-device.txt"
[ "${BREAKDOWN:-1}" = 0 ] || python3 bench/preprocess_profile.py --repeats 10 | tee "$OUT/$label-preprocess.md"
for mode in $MODES; do
  case $mode in
    warm) extra="" ;;
    cold) extra="--prefix-cache-size 0" ;;
    none) extra="--prefix-cache-size 0 --vision-cache-size 0"; [ $label = after ] && extra="$extra --image-cache-size 0" ;;
  esac
  (cd "$SERVE_DIR" && exec python3 -m vlm_serve.cli --model "$MODEL" --port 8131 --log-level warning \
    --no-access-log $extra) > "$OUT/$label-server-$mode.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:8131/health >/dev/null && break; sleep 0.5; done
  python3 bench/multiturn.py --base-url http://127.0.0.1:8131/v1 --turns 5 --conversations 4 \
    --image-size 896 ${IMAGE:-} --max-tokens ${MAX_TOKENS:-32} --result-json "$OUT/$label-$mode.json" | grep -A6 ttft_ms
  kill -TERM $pid; wait $pid
done
[ "${BREAKDOWN:-1}" = 0 ] || python3 bench/multiturn_breakdown.py --model "$MODEL" --conversations 3 --turns 3 | tee "$OUT/$label-breakdown.md"
