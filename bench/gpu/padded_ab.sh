#!/usr/bin/env bash
# The ways CUDA may multiply (VLM_SERVE_MATMUL: exact, the row-exact kernel; padded, MLX's
# matmul on padded passes, the default), on one machine: first the floors padded_matmul
# finds for the model's layers (from the server's startup log), then a burst of image
# requests (engine only, with mlx-vlm's batch_generate beside it) and closed-loop text
# chats, each way in turn.
# Results (JSON, logs, a summary) go to $OUT.
#   OUT=DIR bash bench/gpu/padded_ab.sh [preset]        (default gemma3-4b)
# WAYS picks the ways (default "exact padded"), SWEEP the text chats' concurrency
# levels (default 1,8,64,128); BURST=0 skips the bursts.
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu-padded-ab}
MODEL=/tmp/vlm-bench-$PRESET
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"

WAYS=${WAYS:-exact padded}
if [ "${BURST:-1}" != 0 ]; then
  for way in $WAYS; do
    VLM_SERVE_MATMUL=$way python3 bench/burst.py --model "$MODEL" --engine vlm-serve \
        --result-json "$OUT/burst-$way.json" > "$OUT/burst-$way.log" 2>&1
  done
  python3 bench/burst.py --model "$MODEL" --engine mlx-vlm --result-json "$OUT/burst-mlx-vlm.json" \
      > "$OUT/burst-mlx-vlm.log" 2>&1
fi

for run in $WAYS; do
  VLM_SERVE_MATMUL=$run SERVERS=vlm-serve SWEEP=${SWEEP:-1,8,64,128} LOAD=text TEXT_WORDS=95 \
      OUT="$OUT/text-$run" bash bench/gpu/run.sh "$PRESET" > "$OUT/text-$run.log" 2>&1
done

# shellcheck disable=SC2086  # one argument per way
python3 - "$OUT" $WAYS <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, re, sys
out, ways = pathlib.Path(sys.argv[1]), sys.argv[2:]
log = next((out / f"text-{w}" / "vlm-serve.server.log" for w in ways if w != "exact"), pathlib.Path("-"))
floors = re.findall(r"padded passes where checked: (.*)", log.read_text()) if log.exists() else []
print("floors:", floors[0] if floors else "(not in the log)")
for name in (*ways, "mlx-vlm"):
    path = out / f"burst-{name}.json"
    if path.exists():
        d = json.loads(path.read_text())
        print(f"burst {name}: wall {d['wall_s']:.1f} s, {d['output_tok_s']:.0f} tok/s, "
              f"TTFT mean {d['ttft_mean_s']:.2f} s")
for name in ways:
    path = out / f"text-{name}" / "vlm-serve.json"
    if not path.exists():
        continue
    for r in json.loads(path.read_text())["runs"]:
        m = r["metrics"]
        print(f"text {name} c={r['max_concurrency']}: out {m['output_throughput']:.0f} tok/s, "
              f"steady {m['steady_output_throughput']:.0f}, ITL p50 {m['itl_ms']['median']:.1f} ms, "
              f"TTFT p50/p99 {m['ttft_ms']['median']:.0f}/{m['ttft_ms']['p99']:.0f} ms")
PY
