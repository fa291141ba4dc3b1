#!/usr/bin/env bash
# The CUDA kernels' settings against each other, each keeping a row's bits independent
# of its batch: rows loaded ahead in blocks of at most 32 rows up to 64 rows
# (cuda_matmul.PREFETCH_ROWS_MAX_TILES, SMALL_BLOCK_ROWS), several prefill queries per
# attention block (cuda_attention.MAX_QUERIES_PER_BLOCK) and the tensor-core prefill
# attention (cuda_attention.FLASH_PREFILL), over all of a query's columns a block or in
# chunks (FLASH_CHUNK), and for heads of 512 (FLASH_MAX_DIM); and the matmul's grid
# with a column tile's row blocks first or not (cuda_matmul.ROW_BLOCKS_FIRST). Their
# bit-for-bit tests, their timings, and one prefill pass and one decode step of the
# Gemma-3-4B shape with each setting.
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
  echo "== the same bits whatever the setting"
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_matmul.py tests/test_cuda_attention.py \
    -k "ahead or queries_sharing or flash" 2>&1 | tail -3 | tee "$OUT/tests.txt"
fi

export PYTHONPATH=$PWD
if wanted matmul; then
  echo "== matmul per call"
  python3 bench/matmul_rows.py --timing --variants 2>&1 | tee "$OUT/matmul.txt"
fi
if wanted attention; then
  echo "== 34 layers' prefill attention"
  python3 bench/attention_kernels.py --batch-sizes "" --prefill-lengths 270,2048 2>&1 | tee "$OUT/attention.txt"
  echo "== the same with Gemma 4's widest heads (512)"
  python3 bench/attention_kernels.py --batch-sizes "" --prefill-lengths 270,2048 --prefill-dim 512 2>&1 \
    | tee "$OUT/attention-512.txt"
  echo "== 34 layers' attention of a chat's next turn, after 2,048 cached keys"
  python3 bench/attention_kernels.py --batch-sizes "" --prefill-lengths 16,64,256 --cached 2048 2>&1 \
    | tee "$OUT/attention-cached.txt"
fi

# A bench script with one setting changed from the default: "not-ahead" (rows loaded just
# before their multiply-adds, blocks of up to 128 rows), "columns-first" (the matmul's
# grid over column blocks first, the old order), "blocks-32" (blocks of at most 32
# rows at every count), "queries" (up to 8 prefill queries a block), "per-query" (the
# per-query prefill attention, not the tensor-core one), "chunks" (the tensor-core one
# in chunks of 256 columns), or "default".
with_setting() {
  local setting=$1 script=$2
  shift 2
  python3 - "$setting" "$script" "$@" <<'PY'
import runpy
import sys

from vlm_serve.engine import cuda_matmul
from vlm_serve.engine.decode import cuda_attention

setting, script = sys.argv[1], sys.argv[2]
if setting == "not-ahead":
    cuda_matmul.PREFETCH_ROWS_MAX_TILES, cuda_matmul.SMALL_BLOCK_ROWS = 0, 0
if setting == "columns-first":
    cuda_matmul.ROW_BLOCKS_FIRST = False
if setting == "blocks-32":
    cuda_matmul.ROW_TILES = (1, 2)
if setting == "queries":
    cuda_attention.FLASH_PREFILL, cuda_attention.MAX_QUERIES_PER_BLOCK = False, 8
if setting == "per-query":
    cuda_attention.FLASH_PREFILL = False
if setting == "chunks":
    cuda_attention.FLASH_CHUNK = 256
sys.argv = [script, *sys.argv[3:]]
runpy.run_path(script, run_name="__main__")
PY
}

wanted prefill && for setting in ${PREFILL_SETTINGS:-default chunks per-query}; do
  echo "== $setting: one prefill pass"
  with_setting $setting bench/prefill_pass.py --model $BIG --lengths 270,2048 --reps 5 \
    --out "$OUT/prefill-$setting.json" 2>&1 | tail -4
done
wanted decode && for setting in ${DECODE_SETTINGS:-default columns-first blocks-32 not-ahead}; do
  echo "== $setting: decode step"
  with_setting $setting bench/decode_step.py --model $BIG --batch-sizes 1,32,64,128 --columns engine \
    --steps 32 2>&1 | grep -E "^[0-9]+ " | tee "$OUT/decode-$setting.txt"
done
