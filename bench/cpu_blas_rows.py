"""Which BLAS MLX multiplies through on this CPU, and whether it keeps each of a model's
float32 product shapes' rows the same batched as alone (``vlm_serve.engine.cpu_blas``,
the check the server runs at load where the BLAS is not the bundled one).

    LD_PRELOAD=/path/to/libopenblas.so.0 python bench/cpu_blas_rows.py --model DIR
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_vlm import load

from vlm_serve.engine import cpu_blas


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    args = p.parse_args()
    model, _ = load(args.model)
    print(f"BLAS: {cpu_blas.blas_library()}; rows checked: {', '.join(map(str, cpu_blas.CHECK_ROWS))}")
    for shape, dtype in sorted(cpu_blas._product_shapes(model.language_model), key=lambda s: s[0]):
        if dtype != mx.float32:
            print(f"{shape[1]} inputs to {shape[0]} outputs ({dtype}): MLX's own product, not the BLAS")
            continue
        start = time.perf_counter()
        kept = cpu_blas._keeps_row_bits(shape, dtype)
        print(f"{shape[1]} inputs to {shape[0]} outputs: {'rows keep their bits' if kept else 'ROWS DIFFER'} "
              f"({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
