"""Where MLX's own matmul gives a row the same bits whatever else shares its pass.

For each linear-layer shape of the Gemma-3-4B shape (bfloat16; ``--bits 4`` for MLX's
affine 4-bit), eight probe rows are multiplied in passes of M rows, M from 8 to
``--max-rows`` in steps of ``--step``, the other rows random; and once more with the
pass's rows shuffled. Prints, per shape, the smallest M from which every larger pass
gives the probe rows the bits they get at ``--max-rows``, the passes that differ, whether
a shuffled pass kept every row's bits, and whether one row alone (MLX's gemv) agrees.

    python bench/gpu/matmul_row_floors.py [--max-rows 2048] [--step 8] [--bits 4]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

# (input, output) of Gemma-3-4B's layers: q, k/v, fused q/k/v, o, gate or up, fused
# gate/up, down, and the tied output layer.
SHAPES = [(2560, 2048), (2560, 1024), (2560, 4096), (2048, 2560), (2560, 10240),
          (2560, 20480), (10240, 2560), (2560, 262144)]


def product_of(w: mx.array, bits: int | None):
    if not bits:
        return lambda x: x @ w.T
    wq, scales, biases = mx.quantize(w, 64, bits)
    return lambda x: mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=bits)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--max-rows", type=int, default=2048)
    p.add_argument("--step", type=int, default=8)
    p.add_argument("--bits", type=int, default=None)
    args = p.parse_args()
    rng = np.random.default_rng(1)
    sizes = list(range(args.step, args.max_rows + 1, args.step))

    def bf16(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    print("mlx", mx.__version__, mx.default_device(), "4-bit" if args.bits else "bfloat16")
    for k, n in SHAPES:
        product = product_of(bf16(n, k) * 0.02, args.bits)
        probe, rest = bf16(8, k), bf16(args.max_rows, k)
        bits, shuffled_same = {}, True
        for m in sizes:
            x = mx.concatenate([probe, rest[: m - 8]])
            y = product(x)
            order = rng.permutation(m)
            y_shuffled = product(x[mx.array(order)])[mx.array(np.argsort(order))]
            shuffled_same &= bool(mx.array_equal(y, y_shuffled).item())
            bits[m] = np.array(y[:8].astype(mx.float32)).tobytes()
        ref = bits[sizes[-1]]
        floor = sizes[-1]
        for m in reversed(sizes):
            if bits[m] != ref:
                break
            floor = m
        differ = [m for m in sizes if bits[m] != ref]
        alone = np.array(product(probe[:1]).astype(mx.float32)).tobytes() == ref[: len(ref) // 8]
        shown = ", ".join(map(str, differ[:8])) + (" ..." if len(differ) > 8 else "")
        print(f"{k}x{n}: every pass of M >= {floor} rows alike; {len(differ)} differ ({shown}); "
              f"shuffled rows alike: {shuffled_same}; one row alone alike: {alone}", flush=True)


if __name__ == "__main__":
    main()
