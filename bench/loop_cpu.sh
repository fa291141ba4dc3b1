#!/usr/bin/env bash
# Event-loop CPU per streamed token (Linux): starts vlm-serve on MODEL, streams a closed
# loop of text chats at CONC, and reads the server's main thread's CPU time (the event
# loop: HTTP, SSE chunks) from /proc around the measured run.
#   MODEL=DIR [CONC=32] [VLM_SERVE_EVENT_LOOP=asyncio] bash bench/loop_cpu.sh [label]
set -euo pipefail
LABEL=${1:-run}
PORT=${PORT:-8019}
CONC=${CONC:-32}
OUT=${OUT:-/tmp}
vlm-serve --model "$MODEL" --max-num-seqs "$CONC" --port "$PORT" --no-access-log > "$OUT/loop-$LABEL.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null' EXIT
for _ in $(seq 240); do curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break; sleep 0.5; done
loop_cpu() { awk '{print $14 + $15}' "/proc/$pid/task/$pid/stat"; }  # clock ticks
load() {
  python bench/serve.py --base-url "http://127.0.0.1:$PORT/v1" --max-concurrency "$CONC" \
      --images-per-request 0 --prompt-tokens 32 --quiet "$@"
}
load --num-prompts 8 --max-tokens 32 --warmup 0
before=$(loop_cpu)
load --num-prompts $((3 * CONC)) --max-tokens 256 --result-json "$OUT/loop-$LABEL.json"
after=$(loop_cpu)
python - "$OUT/loop-$LABEL.json" "$before" "$after" "$(getconf CLK_TCK)" "$LABEL" <<'PY'
import json, sys
path, before, after, hz, label = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
m = json.load(open(path))["runs"][0]["metrics"]
tokens, seconds = m["total_output_tokens"], (after - before) / hz
print(f"{label}: event loop {seconds:.2f} s of CPU for {tokens} tokens = {1e6 * seconds / tokens:.0f} us/token; "
      f"{m['output_throughput']:.0f} tok/s, ITL p50 {m['itl_ms']['median']:.1f} ms")
PY
