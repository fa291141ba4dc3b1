"""A vision tower's GELU on the default device: MLX's op against the table lookup
(``vlm_serve/engine/gelu_table.py``), on a bfloat16 activation of SigLIP's MLP width,
and whether the two give the same bits.

    python bench/gelu_table.py --tokens 4096 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import mlx.nn as nn


def timed(f, x, repeat: int) -> float:
    mx.eval(f(x))
    started = time.perf_counter()
    for _ in range(repeat):
        mx.eval(f(x))
    return (time.perf_counter() - started) / repeat * 1000


def main() -> None:
    from vlm_serve.engine import gelu_table

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="rows (an 896x896 image is 4,096 patches)")
    p.add_argument("--width", type=int, default=4304, help="the MLP's width (SigLIP so400m: 4,304)")
    p.add_argument("--approx", default="precise")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    x = (mx.random.normal((args.tokens, args.width), key=mx.random.key(0)) * 3).astype(mx.bfloat16)
    mx.eval(x)
    table = gelu_table.table_for(args.approx, mx.bfloat16)
    gelu = nn.GELU(approx=args.approx)
    result = {
        "device": str(mx.default_device()),
        "shape": list(x.shape),
        "mlx_ms": round(timed(gelu, x, args.repeat), 3),
        "table_ms": round(timed(lambda a: gelu_table.lookup(table, a), x, args.repeat), 3),
        "same_bits": mx.array_equal(gelu(x), gelu_table.lookup(table, x)).item(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
