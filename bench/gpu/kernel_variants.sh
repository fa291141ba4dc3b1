#!/usr/bin/env bash
# The kernel variants that stay off until a GPU run shows they give the default kernels'
# bits: the matmul that stages its chunks in shared memory (cuda_matmul.STAGED_MIN_ROWS),
# the next chunk's rows loaded ahead (cuda_matmul.PREFETCH_ROWS_MAX_TILES), several
# prefill queries per attention block (cuda_attention.MAX_QUERIES_PER_BLOCK) and the
# tensor-core prefill attention (cuda_attention.FLASH_PREFILL). Their
# bit-for-bit tests, their timings against the defaults, and one prefill pass and one
# decode step of the Gemma-3-4B shape with each turned on.
#   OUT=DIR bash bench/gpu/kernel_variants.sh
# STEPS picks parts (default: all of "tests matmul attention prefill decode"), so the run
# can be split across calls shorter than the whole.
set -uo pipefail
OUT=${OUT:-bench/results/gpu-kernel-variants}
STEPS=${STEPS:-tests matmul attention prefill decode}
mkdir -p "$OUT"
BIG=/tmp/vlm-bench-gemma3-4b
[ -f $BIG/config.json ] || PYTHONPATH=$PWD python3 -m fixtures.build --arch gemma3 --preset gemma3-4b --out $BIG > /dev/null 2>&1
wanted() { [[ " $STEPS " == *" $1 "* ]]; }

if wanted tests; then
  echo "== the same bits as the defaults"
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_matmul.py tests/test_cuda_attention.py \
    -k "staged or ahead or queries_sharing or flash" 2>&1 | tail -3 | tee "$OUT/tests.txt"
fi

export PYTHONPATH=$PWD
if wanted matmul; then
  echo "== matmul per call"
  python3 bench/matmul_rows.py --timing --variants 2>&1 | tee "$OUT/matmul.txt"
fi
if wanted attention; then
  echo "== 34 layers' prefill attention"
  python3 bench/attention_kernels.py --batch-sizes "" --prefill-lengths 270,2048 2>&1 | tee "$OUT/attention.txt"
fi

# A bench script with the variants named turned on: "staged" (the staged matmul from 64
# rows), "ahead" (rows loaded ahead, blocks of at most 32 rows), "queries" (up to 8 prefill
# queries a block), "flash" (the tensor-core prefill attention), "all" (staged, ahead,
# flash), or "default".
with_variants() {
  local variants=$1 script=$2
  shift 2
  python3 - "$variants" "$script" "$@" <<'PY'
import runpy
import sys

from vlm_serve.engine import cuda_matmul
from vlm_serve.engine.decode import cuda_attention

variants, script = sys.argv[1], sys.argv[2]
if variants in ("staged", "all"):
    cuda_matmul.STAGED_MIN_ROWS = 64
if variants in ("ahead", "all"):
    cuda_matmul.PREFETCH_ROWS_MAX_TILES, cuda_matmul.ROW_TILES = 2, (1, 2)
if variants == "queries":
    cuda_attention.MAX_QUERIES_PER_BLOCK = 8
if variants in ("flash", "all"):
    cuda_attention.FLASH_PREFILL = True
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
PY
}

wanted prefill && for variants in default staged queries flash all; do
  echo "== $variants: one prefill pass"
  with_variants $variants bench/prefill_pass.py --model $BIG --lengths 270,2048 --reps 5 \
    --out "$OUT/prefill-$variants.json" 2>&1 | tail -4
done
wanted decode && for variants in default ahead staged; do
  echo "== $variants: decode step"
  with_variants $variants bench/decode_step.py --model $BIG --batch-sizes 1,64,128 --columns engine \
    --steps 32 2>&1 | grep -E "^[0-9]+ " | tee "$OUT/decode-$variants.txt"
done
