#!/usr/bin/env bash
# A text burst on the GPU, engine only: bench/prefill_wave.py with every mx.async_eval
# timed by call site, once per setting in SETTINGS (environment assignments, "base" for
# none), alternating ROUNDS times; then one shared prefill pass (bench/prefill_pass.py).
# Results (JSON) go to $OUT.
#   OUT=DIR [REQUESTS=128] [WORDS=95] [ROUNDS=2] \
#     [SETTINGS="base MLX_MAX_OPS_PER_BUFFER=1000,MLX_MAX_MB_PER_BUFFER=8000"] \
#     bash bench/gpu/prefill_wave.sh [preset]
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu-prefill-wave}
MODEL=/tmp/vlm-bench-$PRESET
SETTINGS=${SETTINGS:-base MLX_MAX_OPS_PER_BUFFER=1000,MLX_MAX_MB_PER_BUFFER=8000}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"
# The machine's first run compiles kernels: one uncounted wave first.
python3 bench/prefill_wave.py --model "$MODEL" --requests 16 --prompt-words "${WORDS:-95}" \
    --prefill-step-size 2048 --max-tokens 8 > /dev/null 2>&1
for round in $(seq "${ROUNDS:-2}"); do
  for setting in $SETTINGS; do
    vars=(); [ "$setting" = base ] || IFS=, read -ra vars <<< "$setting"
    label="${setting//[=,]/-}-$round"
    env "${vars[@]}" python3 bench/prefill_wave.py --model "$MODEL" --requests "${REQUESTS:-128}" \
        --prompt-words "${WORDS:-95}" --prefill-step-size 2048 --max-tokens 32 --time-evals \
        --result-json "$OUT/wave-$label.json" > "$OUT/wave-$label.log" 2>&1
    python3 - "$OUT/wave-$label.json" "$label" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(sys.argv[2], {k: d[k] for k in ("wall_s", "ttft_mean_s", "ttft_max_s")},
      {k: round(v) for k, v in d["stages_ms"].items()})
for site, s in d["async_eval_by_site"].items():
    print("   ", site, s["calls"], "calls", s["total_ms"], "ms, cpu", s["cpu_ms"], "ms, p50", s["p50_ms"], "largest", s["largest_ms"])
PY
  done
done
python3 bench/prefill_pass.py --model "$MODEL" --lengths 288 --rows 7 --reps 5 --out "$OUT/pass-7x288.json"
