"""Which row counts give a row the same bits, and what the row-exact matmul costs.

``--classes``: for Gemma-3-4B's weight shapes, ``x @ W.T`` through MLX's matmul (bf16
and 4-bit) and through ``engine/cuda_matmul.py``, at 1 to 4096 rows; each row count is
printed with the first row count whose row 0 has the same bits (one class per kernel
choice). ``--timing``: ms per call of each at decode and prefill row counts (20 calls
per evaluation, after a warm-up). ``--layouts``: the same per call for each choice of
column tiles and warps per block (``cuda_matmul.layout``), with whether its bits equal
the default layout's. ``--variants`` (with ``--timing``): other settings of the kernel
too (``VARIANTS``), each with whether its bits are the default's.

    python bench/matmul_rows.py --classes --timing --variants --layouts
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn

from vlm_serve.engine import cuda_matmul

SHAPES = [(2560, 4096), (2048, 2560), (2560, 20480), (10240, 2560), (2560, 262144)]
CLASS_ROWS = [1, 2, 3, 4, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 256, 512, 1024, 4096]


def layer(width: int, out: int, bits: int | None = None) -> nn.Module:
    linear = nn.Linear(width, out, bias=False)
    linear.weight = (mx.random.normal((out, width), key=mx.random.key(out)) * 0.05).astype(mx.bfloat16)
    if bits:
        linear = nn.QuantizedLinear.from_linear(linear, group_size=64, bits=bits)
    mx.eval(linear.parameters())
    return linear


def rows(count: int, width: int, seed: int = 1) -> mx.array:
    return (mx.random.normal((count, width), key=mx.random.key(seed)) * 0.05).astype(mx.bfloat16)


def classes(fn, x: mx.array) -> str:
    seen: list[tuple[int, mx.array]] = []
    cells = []
    for m in CLASS_ROWS:
        first = fn(x[:m])[:1]
        mx.eval(first)
        same = next((n for n, r in seen if mx.array_equal(r, first).item()), None)
        if same is None:
            seen.append((m, first))
        cells.append(f"{m}:{same or m}")
    return " ".join(cells)


def per_call_ms(fn, inputs: list[mx.array]) -> float:
    for _ in range(2):
        mx.eval([fn(a) for a in inputs])
    start = time.perf_counter()
    for _ in range(5):
        mx.eval([fn(a) for a in inputs])
    return (time.perf_counter() - start) / (5 * len(inputs)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--classes", action="store_true")
    p.add_argument("--timing", action="store_true")
    p.add_argument("--layouts", action="store_true")
    p.add_argument("--variants", action="store_true",
                   help="with --timing: other settings of the kernel too, and whether "
                        "their bits are the default's")
    args = p.parse_args()
    if not cuda_matmul.available():
        raise SystemExit("needs MLX's CUDA backend")
    if args.classes:
        for width, out in SHAPES[:4]:
            x = rows(max(CLASS_ROWS), width)
            for name, module in (("bf16", layer(width, out)), ("4-bit", layer(width, out, 4))):
                print(f"MLX {name:5s} {width}x{out}: {classes(module, x)}", flush=True)
                print(f"exact {name:5s} {width}x{out}: "
                      f"{classes(lambda v, m=module: cuda_matmul.linear(v, m), x)}", flush=True)
    if args.timing:
        for bits in (None, 4):
            for width, out in SHAPES:
                module = layer(width, out, bits)
                for m in (1, 8, 64, 128, 1024):
                    if out > 100_000 and m > 128:
                        continue  # the output layer runs on one position per prompt
                    inputs = [rows(m, width, 7 + i % 5) for i in range(20)]
                    ours = per_call_ms(lambda v: cuda_matmul.linear(v, module), inputs)
                    theirs = per_call_ms(module, inputs)
                    line = (f"{'4-bit' if bits else 'bf16'} {width}x{out} rows {m}: MLX {theirs:.3f} ms, "
                            f"exact {ours:.3f} ms ({ours / theirs:.2f}x)")
                    if args.variants:
                        line += "".join(f", {name} " + variant_timing(settings, module, inputs, theirs)
                                        for name, settings in VARIANTS.items())
                    print(line, flush=True)

    if args.layouts:
        layouts()


# Other settings of the kernel, each giving the default's bits: rows loaded just before
# their multiply-adds (no rows ahead); blocks of at most 32 or 64 rows at every row
# count; and each of those with the grid over column blocks first (the old order).
VARIANTS = {
    "rows not ahead": {"PREFETCH_ROWS_MAX_TILES": 0, "SMALL_BLOCK_ROWS": 0},
    "blocks of 32": {"ROW_TILES": (1, 2)},
    "blocks of 64": {"ROW_TILES": (1, 2, 4)},
    "column blocks first": {"ROW_BLOCKS_FIRST": False},
    "column blocks first, blocks of 32": {"ROW_BLOCKS_FIRST": False, "ROW_TILES": (1, 2)},
    "column blocks first, blocks of 64": {"ROW_BLOCKS_FIRST": False, "ROW_TILES": (1, 2, 4)},
}


def variant_timing(settings: dict, module, inputs: list[mx.array], mlx_ms: float) -> str:
    """ms per call on ``inputs`` with ``cuda_matmul`` set as ``settings``, and whether
    the result has the default kernel's bits."""
    default = cuda_matmul.linear(inputs[0], module)
    saved = {name: getattr(cuda_matmul, name) for name in settings}
    for name, value in settings.items():
        setattr(cuda_matmul, name, value)
    try:
        ms = per_call_ms(lambda v: cuda_matmul.linear(v, module), inputs)
        same = mx.array_equal(cuda_matmul.linear(inputs[0], module), default).item()
    finally:
        for name, value in saved.items():
            setattr(cuda_matmul, name, value)
    return f"{ms:.3f} ms ({ms / mlx_ms:.2f}x{'' if same else ', OTHER BITS'})"


def layouts() -> None:
    """Each choice of column tiles and warps per block (bf16), as ``variant_timing``."""
    for width, out in SHAPES[:4]:
        module = layer(width, out)
        for m in (1, 64, 128, 1024):
            inputs = [rows(m, width, 7 + i % 5) for i in range(20)]
            mlx_ms = per_call_ms(module, inputs)
            tiles = cuda_matmul.layout(m, width)[0]
            cells = [f"ft{column_tiles}/w{warps} " + variant_timing(
                         {"layout": lambda *_, c=column_tiles, w=warps: (tiles, c, w)}, module, inputs, mlx_ms)
                     for column_tiles in (1, 2, 4) for warps in (4, 8)]
            print(f"bf16 {width}x{out} rows {m} (MLX {mlx_ms:.3f} ms): " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
