#!/usr/bin/env bash
# The tests that need a GPU, or that check the promise there, in parts run side by side
# (one process each: the GPU and 16 cores take four at once, and MLX compiles each kernel
# variant on first use, 5-10 s apiece, on as many cores):
#   PART="attention matmul" OUT=DIR bash bench/gpu/tests.sh
# Parts: attention, matmul, norms (the kernels' own tests), shared
# (long prompts in shared passes), families (every family batched against alone, float
# weights, but for shared's cases: give it shared beside it), families-q4 (the same for
# the 4-bit models: where the quantized check refuses them, each test skips with its
# message after the check's own run), steps (the engine decode steps: Gemma 4, GLM-4V,
# Ministral 3, the compile limit), checks (routing, the row-exact install, Gemma 3's
# prefill, the quantized check, shared tower calls, packed pixels, the tower's GELU), q4 (4-bit with
# float32 activations, Gemma 3), parity (the whole parity suite). Each stops itself LIMIT seconds in (default
# 540, with SIGINT, so pytest still prints what passed and failed) and keeps its output
# in $OUT/PART.txt. On an H200 (this file's default parts): attention 7 min, families 7,
# parity 3, steps 3, checks 2. On an H100, with parity, steps and checks beside it,
# families (then with shared's cases) reached LIMIT=545 six tests short of its end.
# MLX keeps the kernels it compiles in MLX_PTX_CACHE_DIR (default $TMPDIR/mlx/VERSION/ptx);
# with CACHE=DIR it uses DIR, and at the end the cache is copied to $OUT/ptx for a later
# machine to start from (kernels are cached by their name and source, so a changed kernel
# compiles again). On an H200 with parity and shared beside it, families with the 4-bit
# models in it reached LIMIT=440 45% in (gpu-h200-turn-parts): hence families-q4.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-tests}
PART=${PART:-attention families families-q4 shared parity steps}
LIMIT=${LIMIT:-540}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
[ -n "${CACHE:-}" ] && mkdir -p "$CACHE" && export MLX_PTX_CACHE_DIR=$CACHE

tests_of() {
  case $1 in
    attention) echo tests/test_cuda_attention.py ;;
    matmul) echo tests/test_cuda_matmul.py ;;
    norms) echo tests/test_cuda_norms.py tests/test_cuda_heads.py ;;
    shared) echo tests/test_families.py -k long_prompts_in_shared ;;
    families) echo tests/test_families.py -k '"not long_prompts_in_shared and not q4"' ;;
    families-q4) echo tests/test_families.py -k '"q4 and not long_prompts_in_shared"' ;;
    steps) echo tests/test_gemma4_step.py tests/test_glm4v_step.py tests/test_ministral3.py tests/test_step_compile.py ;;
    checks) echo tests/test_row_exact.py tests/test_model_attention.py tests/test_gemma3_prefill.py \
              tests/test_quantized_check.py tests/test_tower_sharing.py tests/test_packed_pixels.py \
              tests/test_tower_gelu.py ;;
    q4) echo tests/test_families.py -k '"q4 and gemma3"' ;;
    parity) echo tests/test_parity.py ;;
    *) echo "unknown part: $1" >&2; return 1 ;;
  esac
}

for part in $PART; do
  args=$(tests_of "$part") || continue
  # shellcheck disable=SC2086  # the test ids and -k expression split as written above
  eval timeout -s INT "$LIMIT" python3 -m pytest -q -p no:cacheprovider -rfEs $args > "$OUT/$part.txt" 2>&1 &
done
wait
for part in $PART; do
  echo "== $part"
  grep -E "passed|failed|^FAILED|^ERROR" "$OUT/$part.txt" | tail -6
done

cache=${MLX_PTX_CACHE_DIR:-$(python3 -c 'import mlx.core as mx, tempfile; print(f"{tempfile.gettempdir()}/mlx/{mx.__version__}/ptx")')}
[ -d "$cache" ] && mkdir -p "$OUT/ptx" && cp -r "$cache"/. "$OUT/ptx/" && du -sh "$OUT/ptx"
