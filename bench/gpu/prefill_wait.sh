#!/usr/bin/env bash
# vlm-serve under closed-loop text load with each --prefill-wait-steps in WAITS, the
# settings alternating ROUNDS times on one machine, after the plain forward's envelope.
# Text chats of TEXT_WORDS words (95: ~256 prompt tokens), 256 tokens out, at the
# concurrency levels of SWEEP. Each run's results go to $OUT/wait-W-ROUND/.
# With RATE=R the requests arrive open loop instead (Poisson, R a second; see run.sh).
#   OUT=DIR [WAITS="0 8"] [ROUNDS=2] [SWEEP=64,128] [RATE=R] bash bench/gpu/prefill_wait.sh [preset]
set -uo pipefail
PRESET=${1:-gemma3-4b}
OUT=${OUT:-bench/results/gpu-prefill-wait}
export LOAD=text TEXT_WORDS=${TEXT_WORDS:-95} SWEEP=${SWEEP:-64,128} PER_LEVEL=${PER_LEVEL:-2}
if [ -z "${RATE:-}" ]; then
  OUT="$OUT/envelope" SERVERS=envelope bash bench/gpu/run.sh "$PRESET" > /dev/null 2>&1
  python3 - "$OUT/envelope/envelope.json" <<'PY'
import json, sys
for row in json.load(open(sys.argv[1]))["decode"]:
    print(f"plain forward B={row['batch']}: {row['step_ms']:.1f} ms/step, {row['tok_s']:,.0f} tok/s")
PY
fi
for round in $(seq "${ROUNDS:-2}"); do
  for wait in ${WAITS:-0 8}; do
    echo "== --prefill-wait-steps $wait, round $round"
    OUT="$OUT/wait-$wait-$round" SERVERS=vlm-serve VLM_SERVE_ARGS="--prefill-wait-steps $wait" \
        bash bench/gpu/run.sh "$PRESET" > /dev/null 2>&1
    python3 - "$OUT/wait-$wait-$round/vlm-serve.json" <<'PY'
import json, sys
for run in json.load(open(sys.argv[1]))["runs"]:
    m = run["metrics"]
    print(f"  c={run['max_concurrency']} rate={run.get('request_rate')}: out {m['output_throughput']:,.0f} tok/s, "
          f"steady {m['steady_output_throughput'] or 0:,.0f}, TTFT p50 {m['ttft_ms']['median']:,.0f} ms, "
          f"p99 {m['ttft_ms']['p99']:,.0f} ms, ITL p50 {m['itl_ms']['median']:.1f} ms")
PY
  done
done
