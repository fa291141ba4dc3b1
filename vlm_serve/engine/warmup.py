"""Run every path once before the server reports ready.

On a fresh GPU, MLX compiles each kernel on first use: the first text request took 20 s
and the first vision call 9 s on a CUDA machine. At startup instead:

- a text and an image request (if the model has a vision tower) and a sampled one
  (temperature, top-p, top-k, a repetition penalty: what chat clients send) are
  prefilled and then decoded together as one batch;
- then a prompt that continues the first one, so a prefix-cache hit and the pass that
  goes on from it run too (the first request after a warm-up without it stalled 18 s on
  a fresh H200, though what it compiled is not broken down);
- then, for every number of slots the batch can reach up to ``--max-num-seqs``, one
  prompt decoded as that many rows (copies sharing its prefill): each new batch shape
  costs a trace of the compiled step and kernels built for it (the first 32-row step
  of a fresh H200 took 4 s).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from PIL import Image

from ..preprocess.media import MediaPolicy
from ..preprocess.prompt import PromptContext, prepare_prompt, render_chat
from .decode.store import slot_bucket, slot_buckets
from .types import SamplingParams

log = logging.getLogger("vlm_serve.engine")

_TEXT = "Describe the picture in a few words."


def warm_up(loaded, scheduler) -> None:
    started = time.monotonic()
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 1, loaded.chat_template)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, top_k=40,
                             repetition_penalty=1.1, seed=0, ignore_eos=True)

    def text(rid: str, words: str, params: SamplingParams):
        prompt = render_chat(ctx, [{"role": "user", "content": [{"type": "text", "text": words}]}])
        return prepare_prompt(ctx, rid, prompt, params)

    together = [text("warm-up-text", _TEXT, greedy), text("warm-up-sampled", "Say hello.", sampled)]
    if getattr(loaded.model, "vision_tower", None) is not None:
        try:
            prompt = render_chat(ctx, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _TEXT}]}])
            image = Image.new("RGB", (448, 448), (90, 140, 200))
            together.append(prepare_prompt(ctx, "warm-up-image", prompt, greedy, [image]))
        except Exception as exc:  # noqa: BLE001 - warm-up must never keep the server down
            log.warning("warm-up: no image request (%s)", exc)
    scheduler.run_to_completion(together)
    # Starts from the first prompt's cached prefix (where the family keeps prefixes).
    scheduler.run_to_completion([text("warm-up-continued", _TEXT + " Then say why.", greedy)])
    sizes = _batch_sizes(scheduler, covered={1, len(together)})
    rows = text("warm-up-rows", "Count to three.", replace(greedy, max_tokens=2))
    for size in sizes:
        scheduler.run_to_completion([replace(rows, request_id=f"warm-up-rows-{size}")], copies=size - 1)
    log.info("warm-up: %d request(s), then batches of %s rows, in %.1f s", len(together) + 1,
             ", ".join(map(str, sizes)) or "no more", time.monotonic() - started)


def _batch_sizes(scheduler, covered: set[int]) -> list[int]:
    """Row counts that reach each slot bucket up to the batch's limit that the
    requests before did not (a family decoded one row at a time has one)."""
    if not scheduler.family.batched:
        return []
    limit = scheduler.config.max_num_seqs
    reached = {slot_bucket(n) for n in covered}
    return [min(size, limit) for size in slot_buckets(limit) if size not in reached]
