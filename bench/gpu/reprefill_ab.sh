#!/usr/bin/env bash
# Prompts from cached prefixes a few tokens apart sharing their prefill passes
# (VLM_SERVE_REPREFILL_TOKENS: 0 off, 16 the default) on one machine: first the passes
# a closed loop costs, engine only (bench/prefill_passes.py, text chats and image chats),
# then vlm-serve under closed-loop load at SWEEP, the settings alternating ROUNDS times.
# LOADS picks the server's loads (default "text image": run.sh's text chats of ~256
# tokens, and its image requests). Results go to $OUT; a summary to $OUT/summary.txt.
# PARTS picks "passes", "server" or both (the default): on a fresh machine, where every
# kernel compiles on first use, the whole does not fit one 10-minute call (an H200's
# first call ran out in the server part, gpu-h200-prefix-alignment).
#   OUT=DIR [SWEEP=128] [ROUNDS=2] [LOADS="text image"] [PARTS=passes] bash bench/gpu/reprefill_ab.sh [preset]
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu-reprefill-ab}
MODEL=/tmp/vlm-bench-$PRESET
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"

has_part() { [[ " ${PARTS:-passes server} " == *" $1 "* ]]; }

has_part passes && for r in 0 16; do
  for image in 0 896; do
    python3 bench/prefill_passes.py --model "$MODEL" --concurrency 64 --requests 256 --max-tokens 32 \
        --prompt-tokens 95 --image-size $image --reprefill-tokens $r \
        --result-json "$OUT/passes-r$r-image$image.json" > "$OUT/passes-r$r-image$image.log" 2>&1
  done
done

has_part server && for round in $(seq "${ROUNDS:-2}"); do
  for r in 0 16; do
    for load in ${LOADS:-text image}; do
      VLM_SERVE_REPREFILL_TOKENS=$r SERVERS=vlm-serve SWEEP=${SWEEP:-128} LOAD=$load TEXT_WORDS=95 \
          OUT="$OUT/$load-r$r-$round" bash bench/gpu/run.sh "$PRESET" > "$OUT/$load-r$r-$round.log" 2>&1
    done
  done
done

python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("passes-*.json")):
    d = json.loads(path.read_text())
    print(f"{path.stem}: {d['passes']} passes, {d['rows_per_pass']} rows a pass, "
          f"TTFT mean {d['ttft_mean_ms']:.0f} ms, {d['output_tok_s']:.0f} tok/s")
for path in sorted(out.glob("*-r*-*/vlm-serve.json")):
    for run in json.loads(path.read_text())["runs"]:
        m = run["metrics"]
        print(f"{path.parent.name} c={run['max_concurrency']}: out {m['output_throughput']:.0f} tok/s, "
              f"steady {m['steady_output_throughput'] or 0:.0f}, ITL p50 {m['itl_ms']['median']:.1f} ms, "
              f"TTFT p50/p99 {m['ttft_ms']['median']:.0f}/{m['ttft_ms']['p99']:.0f} ms")
PY
