"""A vision tower's GELU on the default device: MLX's op against the faster forms
(``vlm_serve/engine/tower_gelu.py``: a table lookup, the cube as a float32 product) on
a bfloat16 activation of SigLIP's MLP width, and whether each gives MLX's bits.

    python bench/tower_gelu.py --tokens 4096 --repeat 3
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
    from vlm_serve.engine import tower_gelu

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096, help="rows (an 896x896 image is 4,096 patches)")
    p.add_argument("--width", type=int, default=4304, help="the MLP's width (SigLIP so400m: 4,304)")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    x = (mx.random.normal((args.tokens, args.width), key=mx.random.key(0)) * 3).astype(mx.bfloat16)
    mx.eval(x)
    result = {"device": str(mx.default_device()), "shape": list(x.shape),
              "mlx_ms": round(timed(nn.gelu_approx, x, args.repeat), 3)}
    for form in ("table", "cube"):
        f = tower_gelu.checked_form(form, "precise", mx.bfloat16)
        result[f"{form}_ms"] = round(timed(f, x, args.repeat), 3) if f is not None else None
        result[f"{form}_same_bits"] = f is not None and mx.array_equal(f(x), nn.gelu_approx(x)).item()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
