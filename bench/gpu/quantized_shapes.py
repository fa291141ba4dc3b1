"""MLX's quantized matmul on this machine's default device against the CPU's, per
layer shape: the smallest failing case of a wrong 4-bit product.

    python bench/gpu/quantized_shapes.py [--outputs 64,838] [--inputs 64,128,192]

One line per (dtype, outputs, inputs, rows): the largest difference relative to the
CPU's result (rounding gives ~1e-7 in float32, ~3e-2 in bfloat16; ~1 is a wrong
kernel). 4-bit weights in groups of 64, random normal weights and inputs.
"""

from __future__ import annotations

import argparse

import mlx.core as mx

from vlm_serve.engine.quantized_check import relative_error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--outputs", default="64,838")
    parser.add_argument("--inputs", default="64,128,192")
    parser.add_argument("--rows", default="1,16")
    args = parser.parse_args()
    for dtype in (mx.float32, mx.bfloat16):
        for n in map(int, args.outputs.split(",")):
            for k in map(int, args.inputs.split(",")):
                w = mx.random.normal((n, k), key=mx.random.key(n * 7 + k)).astype(dtype)
                q, s, b = mx.quantize(w, group_size=64, bits=4)
                for rows in map(int, args.rows.split(",")):
                    x = mx.random.normal((rows, k), key=mx.random.key(rows)).astype(dtype)
                    got = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)
                    with mx.stream(mx.cpu):
                        want = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=64, bits=4)
                    print(f"{str(dtype).split('.')[-1]:9} outputs {n:5} inputs {k:5} rows {rows:3} "
                          f"relative error {relative_error(got, want):.3g}", flush=True)


if __name__ == "__main__":
    main()
