#!/usr/bin/env bash
# Where the image burst's decode phase loses ~2 ms a step against the step alone
# (bench/results/gpu-h200-gelu-kernels), and what the burst's first uses and budget cost.
# Gemma-3-4B shape, random bf16. Parts:
#   pacing    the engine's step at 64 rows paced as the scheduler paces it: read back
#             one late, two late, before the next; with 2 ms of host work after each
#             read-back; beside a thread running Python (bench/decode_step.py columns)
#   tower     the vision tower's kernels (ncu) with each form of its GELU (MLX's ops, a
#             table lookup, the cube as a float32 product, that chain in one kernel:
#             VLM_SERVE_TOWER_GELU)
#   variants  the burst as it is, with Python's switch interval at 0.5 ms, and with MLX
#             committing every 200 kernels; twice, in turned order; mlx-vlm once
#   rounds    the burst twice on one engine, inputs ready, with every mark in order: what
#             the first round's new shapes cost
#   budget    the burst at prefill budgets 4096 and 2048, alternating, twice each
#   candidates  the burst as it is, with the tower's GELU in the cube form, and with the
#             4096 budget, then mlx-vlm; and again in turned order without mlx-vlm
#   pipeline  decode attention with its keys and values copied into shared memory
#             asynchronously (cuda_attention.PIPELINE: 5 stages, and 3) against each lane
#             loading its own: the same bits (tests/test_cuda_attention.py), 34 layers'
#             kernels at 64 rows (ncu, twice each, alternating; then 128 and 256 columns
#             a block on 4 warps, pipelined), and the whole compiled step
#   pipeline-burst  the burst as it is and with each lane's own loads, in turned order;
#             mlx-vlm once
#   gelu-burst  the burst as it is and with the tower's GELU in one kernel, in turned
#             order; mlx-vlm once
#   split     decode attention's bits tests at the module's split of pass 1
#             (cuda_attention.DECODE_CHUNK, DECODE_WARPS), then 34 layers' kernels at 64
#             rows (ncu) at 128 columns on 4 warps, 64 on 2 and 256 on 8, twice each
#   norms     the residual add between two norms in each form (cuda_norms.FORMS: reading
#             a row's elements again each pass, or keeping them in registers): its GPU
#             tests, then its kernels (ncu) in the compiled step at 64 rows and in a
#             prefill pass of 4 prompts of 340 tokens, twice each, alternating
#   norms-burst  the burst as it is and with the norms' passes form, in turned order;
#             mlx-vlm once
#   pad       the compiled step's kernels (ncu) at 64 rows with the down projection padded
#             to 320 rows (VLM_SERVE_PAD_SIZES=coarse) and to 264 (as it is: the floor
#             checked at load must come out at 264 for it to change anything; the log
#             says), twice each, alternating
#   pad-burst  the burst as it is and with VLM_SERVE_PAD_SIZES=coarse, in turned order;
#             mlx-vlm once
#   alloc-burst  the burst as it is, with MLX's buffer cache capped as before (burst.sh's
#             fixed-buffer-cache) and with padded passes of at most 2,048 rows
#             (pad-largest-2048), in turned order; mlx-vlm once
#   split-burst  the burst as it is and with 256 columns on 8 warps and the cube GELU
#             (burst.sh's split-256-cube), in turned order; mlx-vlm once
# Each part leaves $OUT/PART.tgz (a run's many files do not all come back from a device
# call) and prints a summary. MODEL=DIR runs pacing, tower, rounds and budget on another
# model (variants and candidates always run bench/gpu/burst.sh's 4B). PARTS picks (each takes minutes;
# split them over calls):
#   OUT=DIR PARTS="pacing tower" bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS=variants bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS="rounds budget" bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS=candidates bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS=pipeline bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS=pipeline-burst bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS="tower gelu-burst" bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS="split split-burst" bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS="norms norms-burst" bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS="pad pad-burst" bash bench/gpu/decode_phase.sh
#   OUT=DIR PARTS=alloc-burst bash bench/gpu/decode_phase.sh
set -uo pipefail
OUT=${OUT:-bench/results/gpu-decode-phase}
PARTS=${PARTS:-pacing tower variants rounds budget candidates pipeline pipeline-burst gelu-burst split split-burst norms norms-burst pad pad-burst}
MODEL=${MODEL:-/tmp/vlm-bench-gemma3-4b}
NCU=${NCU:-$(command -v ncu || echo /usr/local/cuda/bin/ncu)}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
has() { [[ " $PARTS " == *" $1 "* ]]; }
# The parts that run the model build it first; the kernel-only part (split) needs none.
needs_model=(pacing tower rounds budget pipeline norms pad)
for part in "${needs_model[@]}"; do
  if has "$part"; then
    [ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch gemma3 --preset gemma3-4b --out "$MODEL" > "$OUT/build.log" 2>&1
    break
  fi
done

summarize() {  # the headline numbers of each burst result under $1
  for f in "$1"/*.json; do
    [ "$(basename "$f")" = timeline.json ] && continue
    python3 - "$f" <<'PY'
import json, os, sys
d = json.load(open(sys.argv[1]))
keys = ("wall_s", "ttft_mean_s", "ttft_max_s", "step_traces", "rounds")
parts = d.get("worker_ms_to_last_first_token", {})  # [wall, CPU] ms up to the last first token
print(os.path.basename(sys.argv[1]), {k: d[k] for k in keys if k in d},
      {k: parts[k] for k in ("prefill step", "shared pass", "embed", "decode step") if k in parts})
PY
  done
}

archive() {  # $OUT/$1 -> $OUT/$1.tgz
  tar czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"
}

turned_bursts() {  # $1: the part; $2: burst.sh variants, run in that order with mlx-vlm, then reversed
  local reversed
  reversed=$(echo "$2" | tr ' ' '\n' | tac | tr '\n' ' ')
  OUT=$OUT/$1/1 WORKER_PARTS=1 VARIANTS="$2" bash bench/gpu/burst.sh > /dev/null 2>&1
  OUT=$OUT/$1/2 WORKER_PARTS=1 MLX_VLM=0 VARIANTS="$reversed" bash bench/gpu/burst.sh > /dev/null 2>&1
  summarize "$OUT/$1/1"; summarize "$OUT/$1/2"
  archive "$1"
}

if has pacing; then
  mkdir -p "$OUT/pacing"
  python3 bench/decode_step.py --model "$MODEL" --batch-sizes 64 --context 460 --steps 48 \
      --columns engine,engine_served,engine_served_2,engine_taking_turns,engine_served_gap,engine_served_2_gap,engine_served_busy \
      --out "$OUT/pacing/pacing.json" > "$OUT/pacing/pacing.log" 2>&1
  grep "^64" "$OUT/pacing/pacing.log"
  archive pacing
fi

if has tower; then
  mkdir -p "$OUT/tower"
  for g in mlx table cube kernel; do
    VLM_SERVE_TOWER_GELU=$g "$NCU" --profile-from-start off --metrics gpu__time_duration.sum \
        --print-summary per-kernel --csv python3 bench/step_kernels.py --model "$MODEL" --tower-images 8 \
        > "$OUT/tower/gelu-$g.csv" 2> "$OUT/tower/gelu-$g.err"
    echo "== tower, VLM_SERVE_TOWER_GELU=$g"
    python3 bench/step_kernels.py --summarize "$OUT/tower/gelu-$g.csv" 2>/dev/null | head -8
  done
  archive tower
fi

if has variants; then turned_bursts variants "default switch-0.5ms commit-200"; fi

if has rounds; then
  mkdir -p "$OUT/rounds"
  python3 bench/burst.py --model "$MODEL" --engine vlm-serve --rounds 2 --preprocessed --worker-parts \
      --timeline "$OUT/rounds/timeline.json" --result-json "$OUT/rounds/rounds.json" > "$OUT/rounds/rounds.log" 2>&1
  summarize "$OUT/rounds"
  archive rounds
fi

if has budget; then
  mkdir -p "$OUT/budget"
  for run in 1 2; do
    for budget in 4096 2048; do
      python3 bench/burst.py --model "$MODEL" --engine vlm-serve --prefill-token-budget "$budget" --worker-parts \
          --result-json "$OUT/budget/budget-$budget-$run.json" > "$OUT/budget/budget-$budget-$run.log" 2>&1
    done
  done
  summarize "$OUT/budget"
  archive budget
fi

if has candidates; then turned_bursts candidates "default gelu-cube budget-4096"; fi

if has pipeline; then
  mkdir -p "$OUT/pipeline"
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_attention.py -k "pipelined or loads_in_flight or batched" \
      > "$OUT/pipeline/tests.txt" 2>&1
  tail -1 "$OUT/pipeline/tests.txt"
  for run in 1 2; do
    for stages in 0 5 3; do
      "$NCU" --profile-from-start off --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
          --print-summary per-kernel --csv python3 bench/decode_kernels.py --part attention --pipeline "$stages" \
          > "$OUT/pipeline/attention-$stages-$run.csv" 2> "$OUT/pipeline/attention-$stages-$run.err"
      echo "== 34 layers' decode attention at 64 rows, PIPELINE=$stages, run $run"
      python3 bench/step_kernels.py --summarize "$OUT/pipeline/attention-$stages-$run.csv" 2>/dev/null | head -2
      grep partial "$OUT/pipeline/attention-$stages-$run.csv" | grep dram__ | awk -F'","' '{print "   DRAM %", $(NF-1)}'
    done
  done
  for split in 128,4 256,4; do  # other splits with the pipeline: a row's bits follow the split
    "$NCU" --profile-from-start off --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
        --print-summary per-kernel --csv python3 bench/decode_kernels.py --part attention --split "$split" \
        > "$OUT/pipeline/attention-split-$split.csv" 2> "$OUT/pipeline/attention-split-$split.err"
    echo "== 34 layers' decode attention at 64 rows, PIPELINE=5, split $split"
    python3 bench/step_kernels.py --summarize "$OUT/pipeline/attention-split-$split.csv" 2>/dev/null | head -2
  done
  python3 bench/decode_kernels.py --part steps --model "$MODEL" --context 480 --rounds 3 --pipeline 0 2>&1 \
      | tee "$OUT/pipeline/steps.txt" | grep "a step"
  archive pipeline
fi

if has pipeline-burst; then turned_bursts pipeline-burst "default own-loads"; fi

if has gelu-burst; then turned_bursts gelu-burst "default gelu-kernel"; fi

if has split; then
  mkdir -p "$OUT/split"
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_attention.py \
      -k "(matches_mlx and not prefill) or batched or pipelined" \
      > "$OUT/split/tests.txt" 2>&1
  tail -1 "$OUT/split/tests.txt"
  for run in 1 2; do
    for split in 128,4 64,2 256,8; do
      name=${split/,/x}  # no commas in names that come back from a device
      "$NCU" --profile-from-start off --metrics gpu__time_duration.sum \
          --print-summary per-kernel --csv python3 bench/decode_kernels.py --part attention --split "$split" \
          > "$OUT/split/attention-$name-$run.csv" 2> "$OUT/split/attention-$name-$run.err"
      echo "== 34 layers' decode attention at 64 rows, split $split, run $run"
      python3 bench/step_kernels.py --summarize "$OUT/split/attention-$name-$run.csv" 2>/dev/null | head -3
    done
  done
  archive split
fi

if has split-burst; then turned_bursts split-burst "default split-256-cube"; fi

if has norms; then
  mkdir -p "$OUT/norms"
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_norms.py > "$OUT/norms/tests.txt" 2>&1
  tail -1 "$OUT/norms/tests.txt"
  for run in 1 2; do
    for form in passes registers; do
      for what in step prefill; do
        case $what in
          step) args=(--batch 64 --context 600 --compiled) ;;
          prefill) args=(--batch 4 --prefill-length 340) ;;
        esac
        VLM_SERVE_ADD_NORM=$form "$NCU" --profile-from-start off --metrics gpu__time_duration.sum \
            --print-summary per-kernel --csv python3 bench/step_kernels.py --model "$MODEL" "${args[@]}" \
            > "$OUT/norms/$what-$form-$run.csv" 2> "$OUT/norms/$what-$form-$run.err"
        echo "== $what, VLM_SERVE_ADD_NORM=$form, run $run"
        python3 bench/step_kernels.py --summarize "$OUT/norms/$what-$form-$run.csv" 2>/dev/null | head -1
        python3 bench/step_kernels.py --summarize "$OUT/norms/$what-$form-$run.csv" 2>/dev/null | grep add_norm
      done
    done
  done
  archive norms
fi

if has norms-burst; then turned_bursts norms-burst "default norms-passes"; fi

if has pad; then
  mkdir -p "$OUT/pad"
  for run in 1 2; do
    for sizes in coarse fine; do
      VLM_SERVE_PAD_SIZES=$sizes "$NCU" --profile-from-start off --metrics gpu__time_duration.sum \
          --print-summary per-kernel --csv python3 bench/step_kernels.py --model "$MODEL" --batch 64 \
          --context 600 --compiled > "$OUT/pad/step-$sizes-$run.csv" 2> "$OUT/pad/step-$sizes-$run.err"
      echo "== step, VLM_SERVE_PAD_SIZES=$sizes, run $run"
      grep -h "padded passes" "$OUT/pad/step-$sizes-$run.err" | head -1
      python3 bench/step_kernels.py --summarize "$OUT/pad/step-$sizes-$run.csv" 2>/dev/null | head -8
    done
  done
  archive pad
fi

if has pad-burst; then turned_bursts pad-burst "default coarse-pad"; fi

if has alloc-burst; then turned_bursts alloc-burst "default fixed-buffer-cache pad-largest-2048"; fi
