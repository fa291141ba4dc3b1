#!/usr/bin/env bash
# A burst of image requests, engine only: vlm-serve's engine against mlx-vlm's
# batch_generate on the same random-weight model (one 896x896 image + ~64 words in,
# greedy, $MAX_TOKENS out, $REQUESTS at once). Results (JSON) go to $OUT.
#   OUT=DIR [WORKER_PARTS=1] [PREPROCESSED=1] [MLX_VLM=0] [VARIANTS="default lone-towers ..."] \
#       bash bench/gpu/burst.sh [preset]
# (default preset gemma3-4b). WORKER_PARTS=1: vlm-serve's results also say where its
# worker's time went (bench/burst.py --worker-parts); PREPROCESSED=1: vlm-serve's engine
# alone, every request's inputs ready before the clock (--preprocessed). VARIANTS:
# vlm-serve as it is (default), with each request's images in a tower call of their own
# (lone-towers: VLM_SERVE_SHARE_TOWERS=0), with transformers' own rescale and normalize
# (plain-pixels: VLM_SERVE_FAST_PIXELS=0), with float pixels handed to the worker instead
# of uint8 values and a table (float-pixels: VLM_SERVE_PACKED_PIXELS=0), with the vision
# tower's GELU as a lookup in a table of MLX's results, the CPU's default (gelu-table:
# VLM_SERVE_TOWER_GELU=table), with its cube as a float32 product (gelu-cube:
# VLM_SERVE_TOWER_GELU=cube) or that chain in one kernel (gelu-kernel:
# VLM_SERVE_TOWER_GELU=kernel), with
# MLX's CUDA graphs on (cuda-graphs: MLX_USE_CUDA_GRAPHS=1; cuda-graphs-100: also
# MLX_MAX_OPS_PER_BUFFER=100; graphs-cache: with room for 4,000 graphs in MLX's cache
# instead of 100, MLX_CUDA_GRAPH_CACHE_SIZE=4000; graphs-cache-40: that and 40 kernels a
# graph instead of 20, MLX_MAX_OPS_PER_BUFFER=40), with Gemma 3's
# prefill passes on the model code's ops (model-prefill: VLM_SERVE_FUSED_PREFILL=0), with
# every cached prefix reused however short (short-prefixes:
# VLM_SERVE_PREFIX_CACHE_MIN_TOKENS=1), with Python's switch interval at 0.5 ms instead
# of 5 (switch-0.5ms: a sitecustomize; the worker gets the interpreter lock back from
# the event loop sooner), with MLX committing every 200 kernels instead of every ~30
# (commit-200: MLX_MAX_OPS_PER_BUFFER=200 MLX_MAX_MB_PER_BUFFER=2000; MLX holds the host
# back once ten commits are in flight, so this lets it run further ahead of the
# device), with 4,096 prompt tokens prefilled between two decode steps instead of 2,048
# (budget-4096: VLM_SERVE_PREFILL_TOKEN_BUDGET=4096), with the CUDA defaults before the
# cube GELU and the 4096 budget (mlx-gelu-2048: VLM_SERVE_TOWER_GELU=mlx
# VLM_SERVE_PREFILL_TOKEN_BUDGET=2048), with decode attention's lanes loading their own
# keys and values instead of copies into shared memory (own-loads:
# VLM_SERVE_ATTENTION_PIPELINE=0), with decode attention's blocks of 256 columns on 8 warps
# and the tower's GELU in the cube form, the defaults before 128 on 4 and the one-kernel
# GELU (split-256-cube: VLM_SERVE_DECODE_SPLIT=256,8 VLM_SERVE_TOWER_GELU=cube), with the
# residual add between two norms reading a row's elements again each pass instead of
# keeping them in registers (norms-passes: VLM_SERVE_ADD_NORM=passes, the default before
# registers), with decode steps' down projections padded to 320 rows instead of 264
# (coarse-pad: VLM_SERVE_PAD_SIZES=coarse, the default before 264), with MLX's cache of
# freed buffers capped at what the whole KV limit leaves, not what admitted requests
# reserve (fixed-buffer-cache: VLM_SERVE_BUFFER_CACHE=fixed, CUDA's default before), with
# padded passes of at most 2,048 rows, longer ones in pieces (pad-largest-2048:
# VLM_SERVE_PAD_LARGEST=2048, the default before 4,096). mlx-vlm runs once after them,
# unless MLX_VLM=0.
set -uo pipefail
PRESET=${1:-gemma3-4b}
ARCH=${ARCH:-${PRESET%%-*}}
OUT=${OUT:-bench/results/gpu-burst}
REQUESTS=${REQUESTS:-64}
MAX_TOKENS=${MAX_TOKENS:-256}
MODEL=/tmp/vlm-bench-$PRESET
export PYTHONPATH=$PWD
mkdir -p "$OUT"
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch "$ARCH" --preset "$PRESET" --out "$MODEL"
parts=()
[ -n "${WORKER_PARTS:-}" ] && parts+=(--worker-parts)
[ -n "${PREPROCESSED:-}" ] && parts+=(--preprocessed)
for variant in ${VARIANTS:-default}; do
  case $variant in
    default) settings="" ;;
    lone-towers) settings="VLM_SERVE_SHARE_TOWERS=0" ;;
    plain-pixels) settings="VLM_SERVE_FAST_PIXELS=0" ;;
    float-pixels) settings="VLM_SERVE_PACKED_PIXELS=0" ;;
    gelu-table) settings="VLM_SERVE_TOWER_GELU=table" ;;
    gelu-cube) settings="VLM_SERVE_TOWER_GELU=cube" ;;
    gelu-kernel) settings="VLM_SERVE_TOWER_GELU=kernel" ;;
    cuda-graphs) settings="MLX_USE_CUDA_GRAPHS=1" ;;
    cuda-graphs-100) settings="MLX_USE_CUDA_GRAPHS=1 MLX_MAX_OPS_PER_BUFFER=100" ;;
    graphs-cache) settings="MLX_USE_CUDA_GRAPHS=1 MLX_CUDA_GRAPH_CACHE_SIZE=4000" ;;
    graphs-cache-40) settings="MLX_USE_CUDA_GRAPHS=1 MLX_CUDA_GRAPH_CACHE_SIZE=4000 MLX_MAX_OPS_PER_BUFFER=40" ;;
    model-prefill) settings="VLM_SERVE_FUSED_PREFILL=0" ;;
    short-prefixes) settings="VLM_SERVE_PREFIX_CACHE_MIN_TOKENS=1" ;;
    commit-200) settings="MLX_MAX_OPS_PER_BUFFER=200 MLX_MAX_MB_PER_BUFFER=2000" ;;
    budget-4096) settings="VLM_SERVE_PREFILL_TOKEN_BUDGET=4096" ;;
    mlx-gelu-2048) settings="VLM_SERVE_TOWER_GELU=mlx VLM_SERVE_PREFILL_TOKEN_BUDGET=2048" ;;
    own-loads) settings="VLM_SERVE_ATTENTION_PIPELINE=0" ;;
    split-256-cube) settings="VLM_SERVE_DECODE_SPLIT=256,8 VLM_SERVE_TOWER_GELU=cube" ;;
    norms-passes) settings="VLM_SERVE_ADD_NORM=passes" ;;
    coarse-pad) settings="VLM_SERVE_PAD_SIZES=coarse" ;;
    fixed-buffer-cache) settings="VLM_SERVE_BUFFER_CACHE=fixed" ;;
    pad-largest-2048) settings="VLM_SERVE_PAD_LARGEST=2048" ;;
    switch-0.5ms)
      mkdir -p "$OUT/switch-site"
      echo 'import sys; sys.setswitchinterval(0.0005)' > "$OUT/switch-site/sitecustomize.py"
      settings="PYTHONPATH=$OUT/switch-site:$PWD" ;;
    *) echo "unknown variant: $variant" >&2; continue ;;
  esac
  name=vlm-serve${settings:+-$variant}
  # shellcheck disable=SC2086  # the variant's settings are NAME=VALUE words
  env $settings python3 bench/burst.py --model "$MODEL" --engine vlm-serve --requests "$REQUESTS" \
      --max-tokens "$MAX_TOKENS" "${parts[@]}" --result-json "$OUT/burst-$name.json" > "$OUT/burst-$name.log" 2>&1
  tail -12 "$OUT/burst-$name.log"
done
[ "${MLX_VLM:-1}" = 0 ] && exit 0
python3 bench/burst.py --model "$MODEL" --engine mlx-vlm --requests "$REQUESTS" --max-tokens "$MAX_TOKENS" \
    --result-json "$OUT/burst-mlx-vlm.json" > "$OUT/burst-mlx-vlm.log" 2>&1
tail -12 "$OUT/burst-mlx-vlm.log"
