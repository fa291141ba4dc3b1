"""What each Gemma-3-4B layer shape costs on the padded path against the row-exact kernel.

For each shape (bfloat16, random weights): the floor ``padded_matmul.check`` finds, then
the product's time at 1, 8, 64 and 128 rows on the kernel (``cuda_matmul.linear``), on
the padded path (``padded_matmul.linear`` at that floor), and on MLX's matmul as is (not
row-exact). Last, the down projection split in two halves of its input dimension, each
padded to its own floor and summed in float32, against the down projection padded whole.
Times are eager (each product evaluated on its own, so each includes a launch and a
sync): compare them within one run.

    python bench/gpu/padded_linear_costs.py
"""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn

from vlm_serve.engine import cuda_matmul, padded_matmul

# (input, output): fused q/k/v, o, fused gate/up, down, halves and a quarter of down's
# input, the tied output layer.
SHAPES = [(2560, 4096), (2048, 2560), (2560, 20480), (10240, 2560), (5120, 2560), (2560, 2560),
          (2560, 262208)]


def micros(f, x, n: int = 200) -> float:
    for _ in range(5):
        mx.eval(f(x))
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(f(x))
    return (time.perf_counter() - start) / n * 1e6


def bf16_linear(inputs: int, outputs: int) -> nn.Linear:
    layer = nn.Linear(inputs, outputs, bias=False)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    return layer


def main() -> None:
    for inputs, outputs in SHAPES:
        layer = bf16_linear(inputs, outputs)
        floor = padded_matmul.check(layer)
        line = f"{inputs}->{outputs}: floor {floor}"
        for rows in (1, 8, 64, 128):
            x = mx.random.normal((rows, inputs)).astype(mx.bfloat16)
            kernel = micros(lambda x, layer=layer: cuda_matmul.linear(x, layer), x)
            padded = micros(lambda x, layer=layer, floor=floor: padded_matmul.linear(x, layer, floor or 8), x)
            plain = micros(lambda x, layer=layer: x @ layer.weight.T, x)
            line += f" | B={rows} kernel {kernel:.0f} padded {padded:.0f} mlx {plain:.0f} us"
        print(line, flush=True)

    down = bf16_linear(10240, 2560)
    halves = []
    for i in range(2):
        half = nn.Linear(5120, 2560, bias=False)
        half.weight = down.weight[:, i * 5120:(i + 1) * 5120]
        halves.append(half)
    floors = [padded_matmul.check(half) for half in halves]
    print("halves floors", floors)

    def split(x):
        parts = [padded_matmul.linear(x[:, i * 5120:(i + 1) * 5120], half, floor or 8).astype(mx.float32)
                 for i, (half, floor) in enumerate(zip(halves, floors))]
        return (parts[0] + parts[1]).astype(mx.bfloat16)

    for rows in (1, 8, 64, 128, 512):
        x = mx.random.normal((rows, 10240)).astype(mx.bfloat16)
        print(f"split B={rows}: {micros(split, x):.0f} us, "
              f"padded320 {micros(lambda x: padded_matmul.linear(x, down, 320), x):.0f} us, "
              f"kernel {micros(lambda x: cuda_matmul.linear(x, down), x):.0f}", flush=True)


if __name__ == "__main__":
    main()
