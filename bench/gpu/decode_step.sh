#!/usr/bin/env bash
# The decode step on the GPU: graph nodes and time per step of mlx-vlm's plain forward,
# the engine through the model code, and the engine's own decode step (Gemma-3-4B shape,
# random bf16 weights, ragged rows at context 320), plus, on the tiny float32 Gemma 3
# and Qwen2.5-VL fixtures, node counts and a greedy check that the engine's batch (and,
# for comparison, the model-code batch) equals one-at-a-time decoding.
#   OUT=DIR bash bench/gpu/decode_step.sh
set -uo pipefail
OUT=${OUT:-bench/results/gpu-decode-step}
SIZES=${SIZES:-1,8,32,64,128}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
MODEL=/tmp/vlm-bench-gemma3-4b
[ -f "$MODEL/config.json" ] || python3 -m fixtures.build --arch gemma3 --preset gemma3-4b --out "$MODEL"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())' | tee "$OUT/device.txt"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >> "$OUT/device.txt" 2>/dev/null
for arch in gemma3 qwen2_5_vl; do  # tiny float32 fixtures: greedy check and node counts
  [ -f "/tmp/vlm-tiny-$arch/config.json" ] || python3 -m fixtures.build --arch $arch --out "/tmp/vlm-tiny-$arch"
  python3 bench/decode_step.py --model "/tmp/vlm-tiny-$arch" --check 8 --context 100 --steps 40 \
      --out "$OUT/check-tiny-$arch.json" | grep rows_equal
  python3 bench/decode_step.py --model "/tmp/vlm-tiny-$arch" --check 8 --context 100 --steps 40 \
      --model-code --out "$OUT/check-tiny-$arch-model-code.json" | grep rows_equal
  python3 bench/count_nodes.py --model "/tmp/vlm-tiny-$arch" --batch 64 --context 320 \
      --out "$OUT/nodes-tiny-$arch.json" | tail -2
done
python3 bench/count_nodes.py --model "$MODEL" --batch 64 --context 320 --out "$OUT/nodes.json"
python3 bench/decode_step.py --model "$MODEL" --batch-sizes "$SIZES" --context 320 --out "$OUT/steps.json" | grep "_ms"
