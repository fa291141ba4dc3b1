"""The verdict of the engine's vision-tower sharing check (``engine/tower_sharing.py``)
for Gemma 3 fixtures: which call sizes keep every image's bits on this machine, and
what the check took (kernels built on first use included). On the CPU the family
shares any number, so there it reports "any".

    python3 bench/gpu/tower_sharing_check.py [--model DIR ...] [--dtypes float32,bfloat16]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import mlx.core as mx
from mlx_vlm import load

from vlm_serve.engine.families import family_for
from vlm_serve.fixtures.build import cached_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", default=[], help="a Gemma 3 model directory (repeatable)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="tiny Gemma 3 fixtures to check, by dtype")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    print("mlx", mx.__version__, mx.default_device(), flush=True)
    paths = args.model or [str(cached_model("gemma3", dtype=None if d == "float32" else d))
                           for d in args.dtypes.split(",") if d]
    for path in paths:
        model, _ = load(path)
        family = family_for(model)
        size = model.config.vision_config.image_size
        started = time.perf_counter()
        sizes = family.tower_sharing.sizes(mx.zeros((1, 3, size, size))) if family.tower_sharing else "any"
        print(f"{path}: {type(family).__name__}, images of {size} px share calls of {sizes} "
              f"({time.perf_counter() - started:.1f} s)", flush=True)


if __name__ == "__main__":
    main()
