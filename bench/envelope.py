"""The engine envelope: plain batched forward passes of a model, no server.

Times what the hardware achieves with the model's own code, so each server number has a
ratio to it: the vision tower (+ projector) per image, prefill tokens/s, and one decode
step at batch B with C tokens of context already in the cache.

    python bench/envelope.py --model DIR --batch-sizes 1,8,32,64,128 --context 320 \\
        --image-size 896 --result-json bench/results/envelope.json
"""

from __future__ import annotations

import os

# The plain forward runs as mlx-vlm's users run it, with MLX's own defaults: importing
# vlm_serve (below) would turn MLX's CUDA graphs off for the whole process, as the
# server runs. Set MLX_USE_CUDA_GRAPHS=0 to time the plain forward that way too.
os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "1")

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np
from mlx_vlm import load
from mlx_vlm.models import cache as vlm_cache
from PIL import Image

from vlm_serve.engine.families import family_for
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, render_chat, tokenize


def timed(fn, reps: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` (which must evaluate its own outputs)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples)


def vision_time(model, processor, model_type: str, size: int, reps: int) -> dict:
    ctx = PromptContext(processor, model_type, MediaPolicy(), 1)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    prompt = render_chat(ctx, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}])
    ids, inputs = tokenize(ctx, prompt, [image])
    family = family_for(model)
    input_ids = mx.array(ids)[None]
    arrays = {k: [mx.array(a) for a in v] if isinstance(v, list) else mx.array(v) for k, v in inputs.items()}
    with_image = timed(lambda: mx.eval(family.embed(input_ids, arrays)[0]), reps)
    text_only = timed(lambda: mx.eval(family.embed(input_ids, {})[0]), reps)
    return {"image_size": size, "prompt_tokens": int(ids.size), "vision_ms": 1000 * (with_image - text_only)}


def prefill_rate(lm, length: int, reps: int) -> dict:
    tokens = mx.random.randint(10, 1000, (1, length))

    def run():
        cache = vlm_cache.make_prompt_cache(lm)
        hidden = lm.model(tokens, cache=cache)
        mx.eval(hidden[:, -1])

    seconds = timed(run, reps)
    return {"prompt_tokens": length, "prefill_tok_s": length / seconds}


def decode_rate(lm, batch: int, context: int, steps: int) -> dict:
    cache = vlm_cache.make_prompt_cache(lm)
    # Fill the cache without computing full-vocabulary logits.
    mx.eval(lm.model(mx.random.randint(10, 1000, (batch, context)), cache=cache))
    mx.eval([c.state for c in cache])
    y = mx.zeros((batch, 1), mx.int32)

    def step(y):
        logits = lm(y, cache=cache).logits[:, -1, :]
        return mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)

    for _ in range(3):
        y = step(y)
    mx.eval(y)
    t = time.perf_counter()
    for _ in range(steps):
        y = step(y)
        mx.async_eval(y)
    mx.eval(y)
    ms = 1000 * (time.perf_counter() - t) / steps
    return {"batch": batch, "context": context, "step_ms": ms, "tok_s": batch * 1000 / ms}


def engine_decode_rate(model, batch: int, context: int, steps: int) -> dict:
    """The same decode step through the engine's own batch (left-padded batch caches,
    per-row sampling), with no scheduling around it: the engine's overhead over the
    plain forward pass; and the same batch with a bare argmax instead of the sampler."""
    from step_breakdown import build_engine_batch, time_steps

    engine_batch = build_engine_batch(model, batch, context, 2 * steps + 16, ragged=True)
    ms = time_steps(lambda: engine_batch.step().tokens, steps)

    def forward_only():
        logits = model.language_model(engine_batch.next_tokens[:, None], cache=engine_batch.cache).logits
        engine_batch.next_tokens = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.int32)
        return engine_batch.next_tokens

    forward_ms = time_steps(forward_only, steps)
    return {"batch": batch, "context": context, "step_ms": ms, "tok_s": batch * 1000 / ms,
            "forward_only_step_ms": forward_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", default="1,8,32,64,128")
    p.add_argument("--context", type=int, default=320, help="tokens in the cache when decoding")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--image-size", type=int, default=896)
    p.add_argument("--prefill-tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--result-json")
    args = p.parse_args()

    model, processor = load(args.model)
    lm = model.language_model
    result = {
        "model": args.model,
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "vision": vision_time(model, processor, model.config.model_type, args.image_size, args.reps),
        "prefill": prefill_rate(lm, args.prefill_tokens, args.reps),
        "decode": [decode_rate(lm, int(b), args.context, args.steps) for b in args.batch_sizes.split(",")],
        "engine_decode": [
            engine_decode_rate(model, int(b), args.context, args.steps) for b in args.batch_sizes.split(",")
        ],
    }
    print(json.dumps(result, indent=2))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
