#!/usr/bin/env bash
# One GPU benchmark run, three columns: the engine envelope (plain forward passes),
# vlm-serve and mlx-vlm's own server, on the same random-weight model directory and the
# same requests: one 896x896 image and ~64 text tokens in, 256 tokens out, at
# concurrency 1, 8, 32, 64, 128. Results (JSON, plot, logs) go to $OUT.
#   bash bench/gpu/run.sh [preset]        (default gemma3-4b)
# SERVERS picks the columns (default "envelope vlm-serve mlx-vlm"; "vllm-mlx" adds
# vllm-mlx 0.6's continuous-batching server); SWEEP and PER_LEVEL set the concurrency
# levels and requests per unit of concurrency (at least MIN_PER_LEVEL a level, default
# 8: two requests at concurrency 1 swung 25% from run to run); LOAD=text sends text chats of TEXT_WORDS
# words (default 256; the tiny-vocabulary fixture tokenizer makes ~2.7 tokens of a word,
# so TEXT_WORDS=95 gives ~256 prompt tokens) instead of the image requests. PROFILE=1
# samples vlm-serve's threads with py-spy while it serves (PROFILE=native adds C++
# frames; needs py-spy: pip install it, offline from wheels brought along) and
# summarizes them (bench/pyspy_summary.py); the server log lists every scheduler turn
# over 250 ms with its parts. VLM_SERVE_ARGS adds options to vlm-serve's command line.
# RATE=R sends SWEEP x PER_LEVEL requests as Poisson arrivals at R a second instead, at
# most SWEEP (one level) in flight.
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu}
SWEEP=${SWEEP:-1,8,32,64,128}
PER_LEVEL=${PER_LEVEL:-2}
MIN_PER_LEVEL=${MIN_PER_LEVEL:-8}
MODEL=/tmp/vlm-bench-$PRESET
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"

[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/device.txt" 2>/dev/null

SERVERS=${SERVERS:-envelope vlm-serve mlx-vlm}
has() { [[ " $SERVERS " == *" $1 "* ]]; }

if has envelope; then
  python3 bench/envelope.py --model "$MODEL" --batch-sizes "$SWEEP" --context 320 \
      --result-json "$OUT/envelope.json" > "$OUT/envelope.log" 2>&1
fi

wait_up() {  # url pid: wait for the server to answer, or give up if it died
  for _ in $(seq 600); do
    curl -sf "$1" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

if [ "${LOAD:-image}" = text ]; then
  REQUEST="--images-per-request 0 --prompt-tokens ${TEXT_WORDS:-256}"
else
  REQUEST="--image-size 896x896 --images-per-request 1 --prompt-tokens 64"
fi

if [ -n "${RATE:-}" ]; then  # open loop: Poisson arrivals at RATE/s, at most SWEEP in flight
  LEVELS="--max-concurrency $SWEEP --request-rate $RATE --num-prompts $((SWEEP * PER_LEVEL))"
else
  LEVELS="--concurrency-sweep $SWEEP --num-prompts-per-concurrency $PER_LEVEL --min-prompts-per-level $MIN_PER_LEVEL"
fi

sweep() {  # label base_url
  python3 bench/serve.py --base-url "$2" --model "$MODEL" --label "$1" \
      $LEVELS --warmup 4 $REQUEST --max-tokens 256 \
      --result-json "$OUT/$1.json" > "$OUT/$1.bench.log" 2>&1
  tail -8 "$OUT/$1.bench.log"
}

profile_start() {  # pid label: sample the server's threads until profile_stop
  spy=
  [ "${PROFILE:-0}" != 0 ] || return 0
  command -v py-spy > /dev/null || { echo "PROFILE: py-spy is not installed; not profiling"; return 0; }
  # Native frames need the process paused while it is sampled (no --nonblocking).
  py-spy record --pid "$1" --rate 200 --threads --idle --format raw \
      $([ "$PROFILE" = native ] && echo --native || echo --nonblocking) \
      -o "$OUT/$2.pyspy.txt" > "$OUT/$2.pyspy.log" 2>&1 &
  spy=$!
}
profile_stop() {  # label
  [ -n "${spy:-}" ] || return 0
  kill -INT $spy; wait $spy 2>/dev/null
  python3 bench/pyspy_summary.py "$OUT/$1.pyspy.txt" --top 25 > "$OUT/$1.pyspy-summary.txt" 2>&1
  python3 bench/pyspy_summary.py "$OUT/$1.pyspy.txt" --top 25 --thread mlx-worker
}

if has vlm-serve; then
  python3 -m vlm_serve.cli --model "$MODEL" --served-model-name "$MODEL" --port 8000 \
      --max-num-seqs 128 --max-queue-size 1024 --log-level info ${VLM_SERVE_ARGS:-} \
      > "$OUT/vlm-serve.server.log" 2>&1 &
  pid=$!
  if wait_up http://127.0.0.1:8000/health $pid; then
    profile_start $pid vlm-serve
    sweep vlm-serve http://127.0.0.1:8000/v1
    profile_stop vlm-serve
  fi
  kill $pid; wait $pid 2>/dev/null
fi

if has mlx-vlm; then
  python3 -m mlx_vlm.server --model "$MODEL" --port 8080 --max-num-seqs 128 \
      > "$OUT/mlx-vlm.server.log" 2>&1 &
  pid=$!
  wait_up http://127.0.0.1:8080/health $pid && sweep mlx-vlm http://127.0.0.1:8080/v1
  kill $pid; wait $pid 2>/dev/null
fi

if has vllm-mlx; then
  # Its decode batch is capped at --completion-batch-size (default 32): let it batch as
  # many rows as the sweep sends, as vlm-serve does.
  HOME=/tmp/vh vllm-mlx serve "$MODEL" --mllm --continuous-batching --offline --port 8001 \
      --max-num-seqs 128 --completion-batch-size 128 \
      > "$OUT/vllm-mlx.server.log" 2>&1 &
  pid=$!
  wait_up http://127.0.0.1:8001/v1/models $pid && sweep vllm-mlx http://127.0.0.1:8001/v1
  kill $pid; wait $pid 2>/dev/null
fi

python3 bench/plot.py "$OUT"/*-serve.json "$OUT"/mlx-vlm.json "$OUT"/vllm-mlx.json -o "$OUT/plot.png" 2>/dev/null || true
ls -la "$OUT"
