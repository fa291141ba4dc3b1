#!/usr/bin/env bash
# Tensor parallel on two GPUs of one host (NCCL), for issue 14:
#  1. Gemma-3-4B shape (random bf16): the decode step at B=1,32,64, TP=1 vs TP=2 (plain
#     forward of the split model, the engine's step, and the host's share of it), then
#     server throughput at concurrency 1, 32, 64 with vlm-serve --tensor-parallel 1 and 2.
#  2. Qwen2.5-VL-72B shape (random bf16, ~145 GB: no checkpoint is written; each rank
#     draws its own shard in memory): the same step table at TP=2 only (it does not fit
#     one GPU), and server throughput at concurrency 1 and 32 against the plain forward.
# Run on an nvidia-h200-x2 machine from the repository root:
#   OUT=bench/results/gpu-h200x2-tensor-parallel bash bench/gpu/tensor_parallel.sh
# PARTS picks what runs (default "4b 72b"); SWEEP_4B / SWEEP_72B set the concurrency
# levels; PER_LEVEL the requests per unit of concurrency.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-tensor-parallel}
PARTS=${PARTS:-4b 72b}
SWEEP_4B=${SWEEP_4B:-1,32,64}
SWEEP_72B=${SWEEP_72B:-1,32}
PER_LEVEL=${PER_LEVEL:-2}
export PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (see the device notes)
mkdir -p "$OUT"
has() { [[ " $PARTS " == *" $1 "* ]]; }

python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/device.txt" 2>/dev/null
nvidia-smi topo -m >> "$OUT/device.txt" 2>/dev/null

wait_up() {  # url pid: wait for the server to answer, or give up if it died
  for _ in $(seq 1200); do
    curl -sf "$1" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

steps() {  # model tp out [batch sizes]
  local sizes=${4:-1,32,64}
  if [ "$2" = 1 ]; then
    python3 bench/tp_step.py --model "$1" --batch-sizes "$sizes" --out "$3" > "$3.log" 2>&1
  else
    mlx.launch --backend nccl -n "$2" -- python3 bench/tp_step.py --model "$1" \
        --batch-sizes "$sizes" --out "$3" > "$3.log" 2>&1
  fi
  grep '"batch"' "$3.log"
}

serve() {  # label model tp sweep [request flags]
  local label=$1 model=$2 tp=$3 sweep=$4
  python3 -m vlm_serve.cli --model "$model" --served-model-name "$model" --port 8000 \
      --tensor-parallel "$tp" --max-num-seqs 64 --max-queue-size 1024 --warmup \
      --log-level info > "$OUT/$label.server.log" 2>&1 &
  local pid=$!
  if wait_up http://127.0.0.1:8000/health $pid; then
    curl -s http://127.0.0.1:8000/health > "$OUT/$label.health.json"
    python3 bench/serve.py --base-url http://127.0.0.1:8000/v1 --model "$model" --label "$label" \
        --concurrency-sweep "$sweep" --num-prompts-per-concurrency "$PER_LEVEL" --warmup 4 \
        --image-size 896x896 --images-per-request 1 --prompt-tokens 64 --max-tokens 256 \
        --result-json "$OUT/$label.json" > "$OUT/$label.bench.log" 2>&1
    tail -8 "$OUT/$label.bench.log"
  else
    echo "$label: the server did not start (see $OUT/$label.server.log)"
  fi
  kill $pid; wait $pid 2>/dev/null
}

if has 4b; then
  M4=/tmp/vlm-bench-gemma3-4b-unwritten
  [ -f "$M4/config.json" ] || python3 -m vlm_serve.distributed.random_weights \
      --arch gemma3 --preset gemma3-4b --out "$M4"
  echo "== Gemma-3-4B shape: decode step, TP=1 then TP=2"
  steps "$M4" 1 "$OUT/steps-4b-tp1.json"
  steps "$M4" 2 "$OUT/steps-4b-tp2.json"
  echo "== Gemma-3-4B shape: server, TP=1 then TP=2"
  serve 4b-tp1 "$M4" 1 "$SWEEP_4B"
  serve 4b-tp2 "$M4" 2 "$SWEEP_4B"
fi

if has 72b; then
  M72=/tmp/vlm-bench-qwen2_5_vl-72b-unwritten
  [ -f "$M72/config.json" ] || python3 -m vlm_serve.distributed.random_weights \
      --arch qwen2_5_vl --preset qwen2_5_vl-72b --out "$M72"
  echo "== Qwen2.5-VL-72B shape: decode step at TP=2 (plain forward of the split vs engine)"
  steps "$M72" 2 "$OUT/steps-72b-tp2.json" 1,32
  echo "== Qwen2.5-VL-72B shape: server at TP=2"
  serve 72b-tp2 "$M72" 2 "$SWEEP_72B"
fi

python3 - "$OUT" <<'PY'
# One summary: step times TP=1 vs TP=2 (ratio; the issue's target is <= 0.65 at B=1 for
# the 4B shape) and the servers' output throughput per concurrency level.
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
summary = {}
one, two = load("steps-4b-tp1.json"), load("steps-4b-tp2.json")
if one and two:
    summary["4b_step_ratio_tp2_over_tp1"] = {
        r1["batch"]: round(r2["engine_ms"] / r1["engine_ms"], 3)
        for r1, r2 in zip(one["steps"], two["steps"])}
big = load("steps-72b-tp2.json")
if big:
    summary["72b_tp2_steps"] = big["steps"]
for label in ("4b-tp1", "4b-tp2", "72b-tp2"):
    run = load(f"{label}.json")
    if run:
        summary[label] = {str(r["max_concurrency"]): {
            k: r["metrics"][k] for k in ("output_throughput", "steady_output_throughput", "completed", "failed")}
            for r in run["runs"]}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
PY
