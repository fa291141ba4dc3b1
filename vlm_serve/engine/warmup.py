"""Run every path once before the server reports ready.

On a fresh GPU, MLX compiles each kernel on first use: the first text request took 20 s
and the first vision call 9 s on a CUDA machine. A text and an image request (if the
model has a vision tower), prefilled and then decoded together as one batch, pay that
cost at startup instead.
"""

from __future__ import annotations

import logging
import time

from PIL import Image

from ..preprocess.media import MediaPolicy
from ..preprocess.prompt import PromptContext, prepare_prompt, render_chat
from .types import SamplingParams

log = logging.getLogger("vlm_serve.engine")


def warm_up(loaded, scheduler) -> None:
    started = time.monotonic()
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 1, loaded.chat_template)
    params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
    parts = [{"type": "text", "text": "Describe the picture in a few words."}]
    requests = [prepare_prompt(ctx, "warm-up-text", render_chat(ctx, [{"role": "user", "content": parts}]),
                               SamplingParams(**params))]
    if getattr(loaded.model, "vision_tower", None) is not None:
        try:
            prompt = render_chat(ctx, [{"role": "user", "content": [{"type": "image"}, *parts]}])
            image = Image.new("RGB", (448, 448), (90, 140, 200))
            requests.append(prepare_prompt(ctx, "warm-up-image", prompt, SamplingParams(**params), [image]))
        except Exception as exc:  # noqa: BLE001 - warm-up must never keep the server down
            log.warning("warm-up: no image request (%s)", exc)
    scheduler.run_to_completion(requests)
    log.info("warm-up: %d request(s) in %.1f s", len(requests), time.monotonic() - started)
