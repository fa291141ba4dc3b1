"""Why a batched decode step over ragged rows costs more than the plain forward pass.

Times one decode step at batch B in four settings, all with argmax and no scheduler:
  plain      the model's own caches, all rows the same length (the envelope)
  rope_array the same caches, RoPE offsets given as a per-row array (all equal)
  batch_even the engine's batch caches, rows of equal length (no left padding)
  batch_ragged  the engine's batch caches, rows of different lengths (left padded)

    python bench/step_breakdown.py --model DIR --batch 64 --context 320
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np
from mlx_vlm import load
from mlx_vlm.models import cache as vlm_cache

from vlm_serve.engine.families import family_for
from vlm_serve.engine.batch import Batch, JoiningRow
from vlm_serve.engine.prefill import Prefill
from vlm_serve.engine.sampling import BatchSampler
from vlm_serve.engine.types import PreparedRequest, SamplingParams


def time_steps(step, steps: int) -> float:
    for _ in range(3):
        y = step()
    mx.eval(y)
    t = time.perf_counter()
    for _ in range(steps):
        y = step()
        mx.async_eval(y)
    mx.eval(y)
    return 1000 * (time.perf_counter() - t) / steps


def id_limit(model) -> int:
    """An upper bound for random prompt token ids: within the vocabulary (an id past
    it reads outside the embedding table), and away from the tiny fixtures' specials."""
    lm = model.language_model
    text = lm.model if "model" in lm else lm  # Idefics3's language model holds its layers
    return min(1000, text.embed_tokens.weight.shape[0])


class ArrayOffset:
    """Wraps a cache so ``offset`` reads as a per-row array (what batch caches give)."""

    def __init__(self, cache, batch: int):
        self._cache, self._batch = cache, batch

    def __getattr__(self, name):
        return getattr(self._cache, name)

    @property
    def offset(self):
        return mx.full((self._batch,), self._cache.offset, mx.int32)


def plain_step(model, batch, context, steps, array_offset=False) -> float:
    lm = model.language_model
    cache = vlm_cache.make_prompt_cache(lm)
    mx.eval(lm.model(mx.random.randint(10, id_limit(model), (batch, context)), cache=cache))
    run_cache = [ArrayOffset(c, batch) for c in cache] if array_offset else cache
    state = {"y": mx.zeros((batch, 1), mx.int32)}

    def step():
        logits = lm(state["y"], cache=run_cache).logits[:, -1, :]
        state["y"] = mx.argmax(logits, axis=-1)[:, None].astype(mx.int32)
        return state["y"]

    return time_steps(step, steps)


def build_engine_batch(
    model, batch: int, context: int, max_tokens: int, ragged: bool, use_decoder: bool = False,
    prompts: list | None = None,
) -> Batch:
    """The engine's own batch of ``batch`` prefilled text rows of about ``context`` tokens
    (of different lengths when ``ragged``, so the batch caches are left-padded), or of
    the given ``prompts``. Without ``use_decoder`` it decodes through the model code on
    mlx-lm's batch caches."""
    family = family_for(model)
    family.use_decoder = use_decoder
    vocab = model.language_model(mx.zeros((1, 1), mx.int32)).logits.shape[-1]
    engine_batch = Batch(model, family, vocab)
    if prompts is None:
        rng = np.random.default_rng(1)
        prompts = [
            rng.integers(10, id_limit(model), context - (i % 7 if ragged else 0)).astype(np.int32)
            for i in range(batch)
        ]
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        prefill = Prefill(model, family, PreparedRequest(f"b{i}", ids, params), 4096)
        while not prefill.done:
            prefill.step()
        sampler = BatchSampler(vocab)
        sampler.add(params, [])
        first = sampler.sample(prefill.logits).tokens
        engine_batch.add([JoiningRow(prefill.cache, sampler, first, prefill.row_state)])
    return engine_batch


def batch_step(model, batch, context, steps, ragged: bool) -> float:
    engine_batch = build_engine_batch(model, batch, context, steps + 8, ragged)

    def step():
        logits = model.language_model(engine_batch.next_tokens[:, None], cache=engine_batch.cache).logits
        engine_batch.next_tokens = mx.argmax(logits[:, -1, :], axis=-1).astype(mx.int32)
        return engine_batch.next_tokens

    return time_steps(step, steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    model, _ = load(args.model)
    b, c, n = args.batch, args.context, args.steps
    result = {
        "batch": b,
        "context": c,
        "plain_ms": plain_step(model, b, c, n),
        "rope_array_ms": plain_step(model, b, c, n, array_offset=True),
        "batch_even_ms": batch_step(model, b, c, n, ragged=False),
        "batch_ragged_ms": batch_step(model, b, c, n, ragged=True),
    }
    # Rows of equal length within the window need no mask: time the batch caches with
    # their decode mask dropped, and with it given as an additive float mask.
    from mlx_vlm.models import cache as caches

    classes = (caches.BatchKVCache, caches.BatchRotatingKVCache)
    originals = {cls: cls.make_mask for cls in classes}
    try:
        for cls in classes:
            cls.make_mask = lambda self, N, *a, **k: None
        result["batch_even_no_mask_ms"] = batch_step(model, b, c, n, ragged=False)
        for cls in classes:
            cls.make_mask = lambda self, N, *a, _m=originals[cls], **k: mx.where(
                _m(self, N, *a, **k), 0.0, -1e9).astype(mx.bfloat16)
        result["batch_ragged_float_mask_ms"] = batch_step(model, b, c, n, ragged=True)
    finally:
        for cls, m in originals.items():
            cls.make_mask = m
    # The batch rotating caches tie offsets to the keys with mx.depends after every
    # update; time the ragged batch once more without that tie.
    depends = mx.depends
    mx.depends = lambda a, deps: a
    try:
        result["batch_ragged_no_depends_ms"] = batch_step(model, b, c, n, ragged=True)
    finally:
        mx.depends = depends
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
