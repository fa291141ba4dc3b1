#!/usr/bin/env bash
# The tests that need a GPU, in parts that each fit a device call of under ten minutes on
# a fresh machine (MLX compiles each kernel variant on first use, 5-10 s apiece):
#   PART="attention matmul" OUT=DIR bash bench/gpu/tests.sh
# Parts: attention, matmul (the kernels' own tests), families (the bfloat16 engine runs
# against the engine alone), q4 (4-bit with float32 activations, Gemma 3), parity (the
# whole parity suite). Each stops itself LIMIT seconds in (default 540, with SIGINT, so
# pytest still prints what passed and failed) and keeps its output in $OUT/PART.txt.
# MLX keeps the kernels it compiles in MLX_PTX_CACHE_DIR (default $TMPDIR/mlx/VERSION/ptx);
# with CACHE=DIR it uses DIR, and at the end the cache is copied to $OUT/ptx for a later
# machine to start from (kernels are cached by their name and source, so a changed kernel
# compiles again).
set -uo pipefail
OUT=${OUT:-bench/results/gpu-tests}
PART=${PART:-attention matmul}
LIMIT=${LIMIT:-540}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
[ -n "${CACHE:-}" ] && mkdir -p "$CACHE" && export MLX_PTX_CACHE_DIR=$CACHE

tests_of() {
  case $1 in
    attention) echo tests/test_cuda_attention.py ;;
    matmul) echo tests/test_cuda_matmul.py ;;
    families) echo tests/test_families.py -k long_prompts_in_shared ;;
    q4) echo tests/test_families.py -k "q4 and gemma3" ;;
    parity) echo tests/test_parity.py ;;
    *) echo "unknown part: $1" >&2; return 1 ;;
  esac
}

for part in $PART; do
  args=$(tests_of "$part") || continue
  echo "== $part"
  # shellcheck disable=SC2086  # the test ids and -k expression split as written above
  eval timeout -s INT "$LIMIT" python3 -m pytest -q -p no:cacheprovider -rfE $args > "$OUT/$part.txt" 2>&1
  tail -4 "$OUT/$part.txt"
done

cache=${MLX_PTX_CACHE_DIR:-$(python3 -c 'import mlx.core as mx, tempfile; print(f"{tempfile.gettempdir()}/mlx/{mx.__version__}/ptx")')}
[ -d "$cache" ] && mkdir -p "$OUT/ptx" && cp -r "$cache"/. "$OUT/ptx/" && du -sh "$OUT/ptx"
