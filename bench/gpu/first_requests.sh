#!/usr/bin/env bash
# What a freshly started server's first requests wait for (Gemma-3-4B shape, bf16): the
# start-up time (load and warm-up), then one text request alone, one image request
# alone, bursts of 8, 32 and 64 text requests, and a closed loop at concurrency 32.
# Each server starts with empty kernel caches (MLX's PTX cache and the driver's), as
# on a new machine. Per stage: TTFT p50/p99/max, the kernels MLX compiled during it,
# and the scheduler's slow-turn lines. BEFORE=DIR also runs the vlm_serve package in
# DIR (e.g. an older commit's) and labels it "before".
#   OUT=DIR [BEFORE=DIR] [MAX_NUM_SEQS=64] bash bench/gpu/first_requests.sh
set -uo pipefail
OUT=${OUT:-bench/results/gpu-first-requests}
MODEL=${MODEL:-/tmp/vlm-bench-gemma3-4b}
MAX_NUM_SEQS=${MAX_NUM_SEQS:-64}
PORT=8133
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch gemma3 --preset gemma3-4b --out "$MODEL"
OUT=$(cd "$OUT" && pwd)
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/device.txt" 2>/dev/null

load() {  # label, then bench/serve.py arguments
  local label=$1; shift
  touch "$OUT/.mark"
  python3 bench/serve.py --base-url "http://127.0.0.1:$PORT/v1" --warmup 0 --quiet \
      --result-json "$OUT/$run-$label.json" "$@"
  # The kernels MLX compiled during this stage, by name (none, once the warm-up did its job).
  find "$MLX_PTX_CACHE_DIR" -name '*.ptx' -newer "$OUT/.mark" | sed 's|.*/||' > "$OUT/$run-$label.kernels.txt"
  python3 - "$OUT/$run-$label.json" "$label" "$(wc -l < "$OUT/$run-$label.kernels.txt")" <<'PY' | tee -a "$OUT/$run.md"
import json, sys
path, label, kernels = sys.argv[1:]
m = json.load(open(path))["runs"][0]["metrics"]
t = m["ttft_ms"]
print(f"| {label} | {m['completed']}/{m['completed'] + m['failed']} | {t['median']:.0f} | {t['p99']:.0f} "
      f"| {t['max']:.0f} | {m['output_throughput']:.0f} | {kernels} |")
PY
}

serve() {  # run-label package-dir
  run=$1
  export MLX_PTX_CACHE_DIR=/tmp/first-requests-ptx-$run CUDA_CACHE_PATH=/tmp/first-requests-cuda-$run
  rm -rf "$MLX_PTX_CACHE_DIR" "$CUDA_CACHE_PATH"; mkdir -p "$MLX_PTX_CACHE_DIR"
  started=$(date +%s.%N)
  (cd "$2" && exec python3 -m vlm_serve.cli --model "$MODEL" --port $PORT --log-level info \
      --max-num-seqs "$MAX_NUM_SEQS" --no-access-log) > "$OUT/$run.server.log" 2>&1 &
  pid=$!
  for _ in $(seq 1200); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.25
  done
  {
    echo "## $run: ready $(python3 -c "import time; print(f'{time.time() - $started:.1f}')") s after start," \
         "$(find "$MLX_PTX_CACHE_DIR" -name '*.ptx' | wc -l) kernels compiled"
    grep -o "warm-up: .*" "$OUT/$run.server.log"
    echo
    echo "| stage | ok | TTFT p50 ms | p99 | max | out tok/s | kernels compiled |"
    echo "|---|---|---|---|---|---|---|"
  } | tee -a "$OUT/$run.md"
  text="--images-per-request 0 --prompt-tokens 95"
  load text-alone $text --num-prompts 1 --max-concurrency 1 --max-tokens 32 --seed 1
  load image-alone --image-size 896x896 --prompt-tokens 64 --num-prompts 1 --max-concurrency 1 --max-tokens 32 --seed 2
  load burst-8 $text --num-prompts 8 --request-rate inf --max-tokens 64 --seed 3
  load burst-32 $text --num-prompts 32 --request-rate inf --max-tokens 64 --seed 4
  load burst-64 $text --num-prompts 64 --request-rate inf --max-tokens 64 --seed 5
  load loop-32 $text --num-prompts 64 --max-concurrency 32 --max-tokens 256 --seed 6
  load loop-32-again $text --num-prompts 64 --max-concurrency 32 --max-tokens 256 --seed 7
  kill -TERM $pid; wait $pid 2>/dev/null
  { echo; echo '```'; grep -o "slow turn: .*" "$OUT/$run.server.log" | head -40; echo '```'; echo; } >> "$OUT/$run.md"
}

[ -n "${BEFORE:-}" ] && serve before "$BEFORE"
serve after "$PWD"
