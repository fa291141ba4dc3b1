"""Run every path once before the server reports ready.

On a fresh GPU, MLX compiles each kernel on first use, seconds apiece (an H100: 90 s
for the first 16 kernels, 4.6 s for one more the first time a row left a running
batch). At startup instead:

- a text, a sampled (temperature, top-p, top-k, a repetition penalty: what chat
  clients send) and an image request (if the model has a vision tower) are prefilled
  and decoded together as one batch, and leave it one by one (a row leaving moves
  another into its slot);
- a prompt that continues the first one, so a prefix-cache hit and the pass that goes
  on from it run too; where last passes are padded to coarse lengths (on a GPU), one
  such pass of each length up to ``WARM_PASS_TOKENS``: a length's first pass costs the
  host 21-31 ms of per-shape setup on an H100, which turn 2 of a chat would pay;
- a prompt longer than a prefill pass and than any sliding window: several passes, and
  a window that rotates;
- where images share vision-tower calls only of sizes checked to keep each image's
  bits (on CUDA), the check for the warm-up image's shape: every call size runs once;
- for every number of slots the batch can reach up to ``--max-num-seqs``, one prompt
  decoded as that many rows (copies sharing its prefill): each batch shape costs a
  trace of the compiled step and the kernels built for it (the first 32-row step of a
  fresh H200 took 4 s). Then the same with prompts past each of the store's column
  steps up to ``WARM_COLUMNS``, as image chats and their answers reach (an image's
  tokens alone fill most of the first): the store's columns are part of the step's
  shapes. A first burst of image chats on an H200 traced ten of them, ~0.2 s
  (``bench/results/gpu-h200-burst-phases``); warmed past the first step only, it still
  traced three once its rows' answers took them past 512 columns, ~0.36 s
  (``bench/results/gpu-h200-decode-phase``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import mlx.core as mx
import numpy as np
from PIL import Image

from ..preprocess.media import MediaPolicy
from ..preprocess.prompt import PromptContext, prepare_prompt, render_chat
from .decode.store import COLUMN_STEP, round_up_coarsely, slot_bucket, slot_buckets
from .model_inputs import model_arrays
from .prefill import PASS_STEP, Prefill
from .types import PreparedRequest, SamplingParams

log = logging.getLogger("vlm_serve.engine")

_TEXT = "Describe the picture in a few words."
# Padded last passes are warmed up to this many tokens (a chat turn's new tokens).
WARM_PASS_TOKENS = 512
# Decode steps are warmed up for stores of up to this many columns (an image chat and
# its answer: Gemma 3's 256 image tokens, a question and a few hundred tokens out).
WARM_COLUMNS = 1024


def warm_up(loaded, scheduler) -> None:
    """Raises ``RuntimeError`` where a warm-up request fails (a kernel MLX cannot
    compile on this machine, say): the server would fail every request on that path."""
    prefixes = scheduler.prefix_cache
    min_reuse = prefixes.min_reuse if prefixes is not None else None
    if prefixes is not None:
        prefixes.min_reuse = 1  # the warm-up's prompts are short: their prefixes must hit
    try:
        _warm_up(loaded, scheduler)
    except RuntimeError as exc:
        raise RuntimeError(f"warm-up failed (--no-warmup starts without it): {exc}") from exc
    finally:
        if prefixes is not None:
            prefixes.min_reuse = min_reuse


def _warm_up(loaded, scheduler) -> None:
    started = time.monotonic()
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 1, loaded.chat_template)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=40,
                             repetition_penalty=1.1, seed=0, ignore_eos=True)

    def text(rid: str, words: str, params: SamplingParams):
        prompt = render_chat(ctx, [{"role": "user", "content": [{"type": "text", "text": words}]}])
        return prepare_prompt(ctx, rid, prompt, params)

    together = [text("warm-up-text", _TEXT, greedy), text("warm-up-sampled", "Say hello.", sampled)]
    if getattr(loaded.model, "vision_tower", None) is not None:
        try:
            prompt = render_chat(ctx, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": _TEXT}]}])
            image = Image.new("RGB", (448, 448), (90, 140, 200))
            together.append(prepare_prompt(ctx, "warm-up-image", prompt, replace(greedy, max_tokens=8), [image]))
        except Exception as exc:  # noqa: BLE001 - warm-up must never keep the server down
            log.warning("warm-up: no image request (%s)", exc)
    scheduler.run_to_completion(together)
    _check_tower_sharing(scheduler.family, together[-1])
    # Starts from the first prompt's cached prefix (where the family keeps prefixes).
    scheduler.run_to_completion([text("warm-up-continued", _TEXT + " Then say why.", greedy)])
    passes = _padded_passes(loaded, scheduler, together[0])
    long = _long_prompt(loaded, scheduler, text, replace(greedy, max_tokens=2))
    if long is not None:
        scheduler.run_to_completion([long])
    sizes = _batch_sizes(scheduler, covered={1, len(together)})
    rows = text("warm-up-rows", "Count to three.", replace(greedy, max_tokens=2))
    for size in sizes:
        scheduler.run_to_completion([replace(rows, request_id=f"warm-up-rows-{size}")], copies=size - 1)
    wide = _wide_rows(loaded, scheduler, text, replace(greedy, max_tokens=2))
    wide_sizes = _batch_sizes(scheduler, covered=set()) if wide else []
    for prompt in wide:
        for size in wide_sizes:
            scheduler.run_to_completion([replace(prompt, request_id=f"{prompt.request_id}-{size}")],
                                        copies=size - 1)
    batches = [f"{', '.join(map(str, sizes))} rows"] if sizes else []
    if wide_sizes:
        lengths = [str(p.num_prompt_tokens) for p in wide]
        lengths = ", ".join(lengths[:-1]) + " and " + lengths[-1] if len(lengths) > 1 else lengths[0]
        batches.append(f"{', '.join(map(str, wide_sizes))} rows of {lengths} tokens")
    log.info("warm-up: %d request(s)%s%s%s in %.1f s", len(together) + 1 + (long is not None),
             f" (one of {long.num_prompt_tokens} tokens)" if long is not None else "",
             f", padded passes of {passes[0]}-{passes[-1]} tokens ({len(passes)})" if passes else "",
             f", then batches of {' and of '.join(batches)}," if batches else "",
             time.monotonic() - started)
    # Its shapes (the long prompt, a batch of every slot bucket) are not what serving
    # starts with: their freed buffers go back to the device, not into MLX's cache.
    mx.clear_cache()


def _check_tower_sharing(family, image_request: PreparedRequest) -> None:
    """Where images share tower calls only of checked sizes (on CUDA), check them now
    for the warm-up image's shape (the processor's usual one), so that no burst waits
    for it and every call size has run once."""
    pixels = image_request.model_inputs.get("pixel_values")
    if family.tower_sharing is not None and isinstance(pixels, np.ndarray) and pixels.shape[0] == 1:
        family.tower_sharing.sizes(model_arrays(image_request)["pixel_values"])


def _padded_passes(loaded, scheduler, base: PreparedRequest) -> list[int]:
    """Where last passes are padded to coarse lengths, run one pass of each length up
    to ``WARM_PASS_TOKENS`` going on from ``base``'s cached prefix, as a chat's next
    turn does (prefilled directly: nothing is decoded or kept). Returns the lengths."""
    config, family = scheduler.config, scheduler.family
    padded = config.bucket_last_passes and family.pad_last_prefill
    if not (padded and scheduler.prefix_cache is not None and family.prefill_decoder({}) is not None):
        return []
    ids = base.input_ids.tolist()
    limit = min(WARM_PASS_TOKENS, config.prefill_step_size, loaded.max_model_len - len(ids))
    lengths = sorted({round_up_coarsely(n, PASS_STEP) for n in range(2, limit + 1)})
    lengths = [n for n in lengths if n <= limit]
    for n in lengths:
        # The prompt's last token again and again: only the pass's shape matters here.
        request = PreparedRequest(f"warm-up-pass-{n}", np.array(ids + ids[-1:] * n, np.int32),
                                  SamplingParams(max_tokens=1))
        prefill = Prefill(scheduler.model, family, request, config.prefill_step_size,
                          scheduler.prefix_cache, bucket_last_pass=True)
        while not prefill.done:
            prefill.step()
        mx.eval(prefill.logits)
    return lengths


def _long_prompt(loaded, scheduler, text, params: SamplingParams):
    """A text prompt a little longer than a prefill pass and than the longest sliding
    window, where the model's context and the memory limit allow one; else None."""
    windows = [layer.window for layer in scheduler.memory.layout.layers if layer.window]
    target = max([scheduler.config.prefill_step_size, *windows]) + 64
    return _prompt_of(loaded, scheduler, text, "warm-up-long", target, params)


def _wide_rows(loaded, scheduler, text, params: SamplingParams) -> list[PreparedRequest]:
    """Where the batch decodes through a compiled step of the family's, a text prompt
    for each of the store's column steps up to ``WARM_COLUMNS`` past the first (as image
    chats and their answers reach), as far as the model's context and the memory limit
    allow one; else none."""
    if scheduler.batch.decoder is None:  # (a family not batched has none)
        return []
    prompts = []
    for target in range(COLUMN_STEP, WARM_COLUMNS, COLUMN_STEP):
        prompt = _prompt_of(loaded, scheduler, text, f"warm-up-wide-rows-{target}", target, params)
        if prompt is None:
            break
        prompts.append(prompt)
    return prompts


def _prompt_of(loaded, scheduler, text, rid: str, target: int, params: SamplingParams):
    """A text prompt of at least ``target`` tokens, where the model's context and the
    memory limit allow one; else None."""
    if target + params.max_tokens > loaded.max_model_len:
        return None
    words = max(target // 4, 16)
    for _ in range(4):  # tokens per word depend on the tokenizer: scale up to the target
        prompt = text(rid, " ".join(["again"] * words), params)
        if prompt.num_prompt_tokens >= target:
            break
        words = words * target // max(prompt.num_prompt_tokens, 1) + 16
    if prompt.num_prompt_tokens < target or scheduler.memory.alone(prompt) > scheduler.memory.limit:
        return None
    return prompt


def _batch_sizes(scheduler, covered: set[int]) -> list[int]:
    """Row counts that reach each slot bucket up to the batch's limit that the
    requests before did not (a family decoded one row at a time has one)."""
    if not scheduler.family.batched:
        return []
    limit = scheduler.config.max_num_seqs
    reached = {slot_bucket(n) for n in covered}
    return [min(size, limit) for size in slot_buckets(limit) if size not in reached]
