#!/usr/bin/env bash
# Image requests' time to first token while the server decodes a closed text load, with
# the server's Python switch interval at each of SWITCH_INTERVALS (seconds), ROUNDS times
# alternating: how long a new image waits for the interpreter lock that the MLX worker
# holds while it builds its graphs (bench/results/cpu-image-processor/README.md).
#   MODEL=DIR [SWITCH_INTERVALS="0.005 0.001"] [ROUNDS=3] [TEXT_CONCURRENCY=8] [IMAGES=12] \
#       [OUT=DIR] bash bench/image_ttft_under_load.sh
set -u
MODEL=${MODEL:?MODEL=DIR}
OUT=${OUT:-/tmp/vlm-image-ttft}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
for round in $(seq "${ROUNDS:-3}"); do
  for interval in ${SWITCH_INTERVALS:-0.005 0.001}; do
    run=$OUT/$interval-$round
    mkdir -p "$run/site"
    echo "import sys; sys.setswitchinterval($interval)" > "$run/site/sitecustomize.py"
    port=$((8600 + RANDOM % 300))
    PYTHONPATH="$run/site:${PYTHONPATH:-}" $PY -m vlm_serve.cli --model "$MODEL" --port $port --no-access-log \
        --max-num-seqs 16 > "$run/server.log" 2>&1 &
    server=$!
    for _ in $(seq 600); do  # until it answers, or it died
      curl -sf "http://127.0.0.1:$port/health" > /dev/null && break
      kill -0 $server 2>/dev/null || { echo "the server stopped: $run/server.log" >&2; exit 1; }
      sleep 0.5
    done
    base=http://127.0.0.1:$port/v1
    $PY bench/serve.py --base-url $base --num-prompts 100000 --max-concurrency "${TEXT_CONCURRENCY:-8}" \
        --images-per-request 0 --max-tokens 256 --prompt-tokens 128 --warmup 0 --quiet > "$run/text.log" 2>&1 &
    text=$!
    sleep 3
    $PY bench/serve.py --base-url $base --num-prompts "${IMAGES:-12}" --max-concurrency 1 --images-per-request 1 \
        --image-format png --image-size 896x896 --max-tokens 4 --prompt-tokens 16 --warmup 1 --quiet \
        --result-json "$run/image.json" > "$run/image.log" 2>&1
    kill $text 2>/dev/null; wait $text 2>/dev/null
    kill $server; wait $server 2>/dev/null
    $PY -c "
import json, sys
m = json.load(open(sys.argv[1]))['runs'][0]['metrics']['ttft_ms']
print(f'switch interval {float(sys.argv[2]) * 1000:g} ms, round {sys.argv[3]}: image TTFT p50 {m[\"median\"]:.0f}, '
      f'mean {m[\"mean\"]:.0f}, p99 {m[\"p99\"]:.0f} ms')" "$run/image.json" "$interval" "$round" | tee -a "$OUT/summary.txt"
  done
done
