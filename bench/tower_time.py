"""Device time of the vision tower (and projector) per image, by images per call, and
of its attention alone, for the burst's question: how much of a burst's prefill phase
the towers' device time takes.

    python bench/tower_time.py --model DIR [--images 1,4,8,16] [--reps 5]

Each call runs on an idle device and is waited for (``mx.eval``), so its time is the
device's plus the launch. ``attention`` times ``mx.fast.scaled_dot_product_attention``
on the tower's query/key/value shape for the same images, once per layer, as the tower
calls it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_vlm import load

from vlm_serve.engine.families import family_for


def timed(fn, reps: int) -> float:
    """Median ms of ``fn()`` evaluated, each run on an idle device."""
    mx.eval(fn())
    times = []
    for _ in range(reps):
        mx.synchronize()
        t = time.perf_counter()
        mx.eval(fn())
        times.append(1000 * (time.perf_counter() - t))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--images", default="1,4,8,16")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    model, processor = load(args.model)
    family = family_for(model)
    vision = model.config.vision_config
    size, patch = vision.image_size, vision.patch_size
    heads, dim = vision.num_attention_heads, vision.hidden_size // vision.num_attention_heads
    tokens, layers = (size // patch) ** 2, vision.num_hidden_layers
    dtype = model.language_model.model.embed_tokens.weight.dtype
    ids = mx.zeros((1, 1), mx.int32)
    rows = []
    for n in (int(x) for x in args.images.split(",")):
        pixels = mx.random.uniform(shape=(n, 3, size, size)).astype(mx.float32)
        q, k, v = (mx.random.normal((n, heads, tokens, dim)).astype(dtype) for _ in range(3))
        mx.eval(pixels, q, k, v)
        scale = dim ** -0.5
        tower = timed(lambda: family.encode_images(ids, pixels, {"pixel_values": pixels}), args.reps)
        attention = timed(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
                                   for _ in range(layers)], args.reps)
        row = {"images": n, "tower_ms": round(tower, 2), "tower_ms_per_image": round(tower / n, 2),
               "attention_ms": round(attention, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({"device": str(mx.default_device()), "mlx": mx.__version__, "tokens": tokens,
                      "heads": heads, "head_dim": dim, "layers": layers, "rows": rows}))


if __name__ == "__main__":
    main()
