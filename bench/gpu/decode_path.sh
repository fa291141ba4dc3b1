#!/usr/bin/env bash
# The decode-path targets' numbers on one GPU, in one run (Gemma-3-4B shape, random bf16):
#   kernels    the CUDA decode-attention kernels against MLX's attention, and a row batched
#              against the same row alone (tests/test_cuda_attention.py)
#   check      batch-vs-alone greedy agreement, tiny float32 Gemma 3 and Qwen2.5-VL: the
#              engine step against each row alone through the model code, and against
#              each row alone through the engine, with its kernels and with MLX's or the
#              grouped attention
#   steps      decode step per batch size: plain forward, model code, engine step
#              (compiled, op by op, and with MLX's, the grouped and the per-head attention)
#   burst      64 image requests at once, engine only: vlm-serve vs mlx-vlm's batch_generate
#   servers    closed-loop text chats (TEXT_WORDS): the plain forward's rates (envelope),
#              vlm-serve and vllm-mlx at concurrency $SWEEP (bench/gpu/run.sh, LOAD=text)
#   multiturn  multi-turn image chat: each turn's TTFT split into its stages
#   wave       a burst of 64 text prompts, engine only: where the first wave's turns go
#              (bench/prefill_wave.py; WAVE_ENVS compares MLX settings, STEP sets the
#              pass length, WAVE_SYNC=1 waits after each stage; PROFILE=1 or native
#              adds a run under py-spy)
# Everything writes under $OUT; PARTS picks what runs (each part takes minutes: split
# long runs into several invocations on the same machine), e.g.
#   OUT=DIR PARTS="check steps burst" bash bench/gpu/decode_path.sh
#   OUT=DIR PARTS="servers multiturn" bash bench/gpu/decode_path.sh
set -uo pipefail
OUT=${OUT:-bench/results/gpu-decode-path}
PARTS=${PARTS:-kernels check steps burst servers multiturn wave}
MODEL=/tmp/vlm-bench-gemma3-4b
export PYTHONPATH=$PWD
mkdir -p "$OUT"
has() { [[ " $PARTS " == *" $1 "* ]]; }

python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/device.txt" 2>/dev/null
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch gemma3 --preset gemma3-4b --out "$MODEL"

if has kernels; then
  python3 -m pytest -q -p no:cacheprovider --noconftest tests/test_cuda_attention.py 2>&1 | tail -15 | tee "$OUT/kernels.txt"
fi
if has check; then
  for arch in gemma3 qwen2_5_vl; do
    tiny=/tmp/vlm-tiny-$arch
    [ -f "$tiny/config.json" ] || python3 -m fixtures.build --arch $arch --out "$tiny" > /dev/null
    for variant in ${VARIANTS:-model-code-alone engine-alone mlx-engine-alone grouped-engine-alone}; do
      case $variant in
        model-code-alone) flags="" ;;
        engine-alone) flags="--engine-alone" ;;
        mlx-engine-alone) flags="--engine-alone --attention mlx" ;;
        grouped-engine-alone) flags="--engine-alone --attention grouped" ;;
        per-head-model-code-alone) flags="--attention per-head" ;;
      esac
      echo "$arch $variant: $(python3 bench/decode_step.py --model "$tiny" --check 8 --context 100 \
          --steps 40 $flags --out "$OUT/check-$arch-$variant.json" | grep rows_equal)"
    done
  done
fi
if has steps; then
  python3 bench/decode_step.py --model "$MODEL" --batch-sizes "${SIZES:-1,64,128}" --context 320 \
      ${COLUMNS:+--columns $COLUMNS} --out "$OUT/steps.json" | grep "_ms"
fi
if has burst; then
  OUT=$OUT bash bench/gpu/burst.sh gemma3-4b
fi
if has servers; then
  OUT=$OUT SERVERS="envelope vlm-serve vllm-mlx" LOAD=text SWEEP=${SWEEP:-1,8,32,64} \
      bash bench/gpu/run.sh gemma3-4b
fi
if has multiturn; then
  python3 bench/multiturn_breakdown.py --model "$MODEL" --image-size 896 --turns 3 --conversations 2 \
      --max-tokens 16 --result-json "$OUT/multiturn-breakdown.json" | tail -8
fi
if has wave; then
  # WAVE_ENVS: MLX settings to compare, one run each ("base": none), e.g.
  # "base MLX_CUDA_GRAPH_CACHE_SIZE=4000 MLX_USE_CUDA_GRAPHS=0". Kernels MLX compiles
  # during a run (new modules in its PTX cache) are listed in wave-*.jit.txt.
  wave="bench/prefill_wave.py --model $MODEL --requests 64 --prompt-words 256 --prefill-step-size ${STEP:-512}"
  ptx=${MLX_PTX_CACHE_DIR:-/tmp/mlx-ptx}; export MLX_PTX_CACHE_DIR=$ptx; mkdir -p "$ptx"
  for setting in ${WAVE_ENVS:-base}; do
    name=${setting//[^A-Za-z0-9]/_}
    touch "$OUT/.mark"
    env $([ "$setting" = base ] || echo "$setting") python3 $wave ${WAVE_SYNC:+--sync} \
        --result-json "$OUT/wave-$name.json" | grep -E '"(wall_s|ttft_mean_s|ttft_max_s|steady_tok_s)"' \
        | sed "s/^/$setting /"
    find "$ptx" -name '*.ptx' -newer "$OUT/.mark" | sed 's|.*/||' > "$OUT/wave-$name.jit.txt"
    echo "$setting: $(wc -l < "$OUT/wave-$name.jit.txt") kernels compiled"
  done
  if [ "${PROFILE:-0}" != 0 ] && command -v py-spy > /dev/null; then
    py-spy record --rate 100 --threads --idle --format raw $([ "$PROFILE" = native ] && echo --native) \
        -o "$OUT/wave.pyspy.txt" -- python3 $wave --result-json "$OUT/wave-profiled.json" > /dev/null
    python3 bench/pyspy_summary.py "$OUT/wave.pyspy.txt" --top 40 --thread mlx-worker > "$OUT/wave.pyspy-summary.txt"
  fi
fi
