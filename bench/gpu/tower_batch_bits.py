"""Whether each image's vision-tower features keep their bits when images share a tower
call, and what sharing saves: the tower (and projector) run on each image alone, then on
the first B images stacked, for several B, first on MLX's own ops, then with the tower's
linear layers on padded passes (``padded_matmul``, pieces of its largest size).

    python bench/gpu/tower_batch_bits.py --model DIR [--images 32]

Prints, per way, how many images of each stacked call matched their features alone, and
the time of one image alone against a call of 16.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_vlm import load

from vlm_serve.engine import padded_matmul, row_exact


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--images", type=int, default=32)
    args = p.parse_args()

    model, _ = load(args.model)
    n, size = args.images, model.config.vision_config.image_size
    pixels = mx.array(np.random.default_rng(0).standard_normal((n, 3, size, size)).astype(np.float32))
    dtype = model.language_model.model.embed_tokens.weight.dtype

    def tower(p: mx.array) -> mx.array:  # as Gemma 3's get_input_embeddings calls it
        hidden, _, _ = model.vision_tower(p.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True)
        return model.multi_modal_projector(hidden)

    def ms(f, reps: int = 3) -> float:
        mx.eval(f())
        start = time.perf_counter()
        for _ in range(reps):
            mx.eval(f())
        return (time.perf_counter() - start) / reps * 1e3

    def report(label: str) -> None:
        alone = [np.array(tower(pixels[i:i + 1]).astype(mx.float32)) for i in range(n)]
        matched = {}
        for b in (b for b in (2, 3, 4, 8, 16, 32, 64) if b <= n):
            out = np.array(tower(pixels[:b]).astype(mx.float32))
            matched[b] = sum(np.array_equal(out[i:i + 1], alone[i]) for i in range(b))
        b = min(n, 16)
        one, many = ms(lambda: tower(pixels[:1])), ms(lambda: tower(pixels[:b]))
        print(f"{label}: images matching alone, by call size: {matched}; "
              f"one image {one:.1f} ms, {b} images {many:.1f} ms ({many / b:.1f} an image)", flush=True)

    report("MLX's ops")
    for part in (model.vision_tower, model.multi_modal_projector):
        for _, module in part.named_modules():
            if type(module) is nn.Linear:
                module.__class__ = row_exact._EXACT[nn.Linear]
                row_exact.prepare(module)
    print("floors:", padded_matmul.describe())
    report("padded linears")


if __name__ == "__main__":
    main()
