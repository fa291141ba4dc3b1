#!/usr/bin/env bash
# Where the server's decode turns go under load, setting against setting, on one machine:
# vlm-serve under closed-loop text chats at SWEEP (default 128), once per variant in
# VARIANTS, ROUNDS times alternating, then the plain forward for the ratio. Each run's
# server log has the engine's periodic line with its decode turns' parts (building the
# step, queueing it, waiting for the one before, the rows' bookkeeping, rows leaving,
# the rest: prefill and admission); $OUT/summary.txt collects them with the throughput.
#   OUT=DIR [VARIANTS="default engine graphs compile128"] [ROUNDS=1] bash bench/gpu/turn_parts.sh [preset]
# Variants: default (today's settings), engine (the same closed loop on the engine
# alone, no HTTP: bench/prefill_passes.py; beside default, what streaming the tokens
# costs the worker), graphs (MLX's CUDA graphs on, their cache large enough for every
# topology), compile128 (the compiled decode step up to 128 slots), switch1ms (Python's
# switch interval at 1 ms, from a sitecustomize on the path).
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu-turn-parts}
SWEEP=${SWEEP:-128}
PER_LEVEL=${PER_LEVEL:-4}
MODEL=/tmp/vlm-bench-$PRESET
mkdir -p "$OUT"
export PYTHONPATH=$PWD
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"

variant_env() {
  case $1 in
    default|engine) echo "" ;;
    graphs) echo "MLX_USE_CUDA_GRAPHS=1 MLX_CUDA_GRAPH_CACHE_SIZE=4000" ;;
    compile128) echo "VLM_SERVE_CUDA_COMPILE_MAX_SLOTS=128" ;;
    switch1ms)
      mkdir -p "$OUT/switch1ms-site"
      echo 'import sys; sys.setswitchinterval(0.001)' > "$OUT/switch1ms-site/sitecustomize.py"
      echo "PYTHONPATH=$OUT/switch1ms-site" ;;
    *) echo "unknown variant: $1" >&2; return 1 ;;
  esac
}

for round in $(seq "${ROUNDS:-1}"); do
  for v in ${VARIANTS:-default engine graphs compile128}; do
    settings=$(variant_env "$v") || continue
    if [ "$v" = engine ]; then
      python3 bench/prefill_passes.py --model "$MODEL" --concurrency "$SWEEP" --requests $((SWEEP * PER_LEVEL)) \
          --max-tokens 256 --prompt-tokens 95 --result-json "$OUT/engine-$round.json" > "$OUT/engine-$round.log" 2>&1
      continue
    fi
    # shellcheck disable=SC2086  # the variant's settings are NAME=VALUE words
    env $settings SERVERS=vlm-serve SWEEP="$SWEEP" PER_LEVEL="$PER_LEVEL" LOAD=text TEXT_WORDS=95 \
        OUT="$OUT/$v-$round" bash bench/gpu/run.sh "$PRESET" > "$OUT/$v-$round.log" 2>&1
  done
done
SERVERS=envelope SWEEP="$SWEEP" OUT="$OUT/envelope" bash bench/gpu/run.sh "$PRESET" > "$OUT/envelope.log" 2>&1

python3 - "$OUT" <<'PY' | tee "$OUT/summary.txt"
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
plain = None
envelope = out / "envelope" / "envelope.json"
if envelope.exists():
    plain = json.loads(envelope.read_text())["decode"][-1]["tok_s"]
    print(f"plain forward: {plain:.0f} tok/s")
for path in sorted(out.glob("engine-*.json")):
    d = json.loads(path.read_text())
    print(f"{path.stem} (no HTTP) c={d['concurrency']}: {d['output_tok_s']:.0f} tok/s over the whole run, "
          f"TTFT mean {d['ttft_mean_ms']:.0f} ms")
    print("   ", d["decode_turns"])
for run_dir in sorted(p.parent for p in out.glob("*-*/vlm-serve.json")):
    for run in json.loads((run_dir / "vlm-serve.json").read_text())["runs"]:
        m = run["metrics"]
        steady = m["steady_output_throughput"] or 0
        ratio = f" ({steady / plain:.2f}x the plain forward)" if plain else ""
        print(f"{run_dir.name} c={run['max_concurrency']}: steady {steady:.0f} tok/s{ratio}, "
              f"ITL p50 {m['itl_ms']['median']:.1f} ms, TTFT p50/p99 "
              f"{m['ttft_ms']['median']:.0f}/{m['ttft_ms']['p99']:.0f} ms")
    for line in (run_dir / "vlm-serve.server.log").read_text().splitlines():
        if "decode turns of" in line:
            print("   ", line.rsplit("; ", 1)[-1])
PY
