"""The image processor's time per image, as the server loads it (with the faster exact
rescale and normalize, ``preprocess/fast_pixels.py``) against the same processor as
mlx-vlm loads it, alternating in one process; the pixels are checked equal to the bit.
``--busy-thread``: with another thread running Python meanwhile, as the MLX worker does
while it builds a step's graph (each call then waits for the interpreter lock after
every NumPy or PIL call that gave it up).

    python bench/image_processor.py --model DIR [--sizes 896x896,1280x720] [--repeats 20] [--busy-thread]
"""

from __future__ import annotations

import argparse

import numpy as np
from alternating import median_ms, start_busy_thread
from mlx_vlm import load as vlm_load
from PIL import Image

from vlm_serve.engine.loader import load


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--sizes", default="896x896,1280x720")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--busy-thread", action="store_true", help="with a thread running Python beside")
    args = p.parse_args()
    if args.busy_thread:
        start_busy_thread()
    ways = {"transformers": vlm_load(args.model)[1].image_processor,
            "server": load(args.model).processor.image_processor}
    print(f"{type(ways['server']).__name__}, faster rescale and normalize installed: "
          f"{getattr(ways['server'], '_fast_pixels', False)}")
    rng = np.random.default_rng(0)
    for size in args.sizes.split(","):
        w, h = map(int, size.split("x"))
        image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        pixels = {name: np.ascontiguousarray(ip(images=[image], return_tensors="np")["pixel_values"])
                  for name, ip in ways.items()}
        same = np.array_equal(pixels["transformers"].view(np.uint8), pixels["server"].view(np.uint8))
        medians = median_ms({name: lambda ip=ip: ip(images=[image], return_tensors="np")
                             for name, ip in ways.items()}, args.repeats)
        print(f"{size}: " + ", ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items())
              + f" (median of {args.repeats}); same bits: {same}")


if __name__ == "__main__":
    main()
