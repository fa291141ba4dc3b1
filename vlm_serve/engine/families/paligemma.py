"""PaliGemma: attention over the whole prompt is bidirectional (mlx-vlm's Gemma text
model passes no mask at all), so a prompt is prefilled in one piece, as mlx-vlm does.

With no mask, a left-padded row of the batch would attend to its padding; each decode
step passes the mask of every row's real keys instead.
"""

from __future__ import annotations

import mlx.core as mx

from .base import Family


class PaliGemma(Family):
    name = "paligemma"
    # A prefix's keys depend on the tokens after it (bidirectional): never reuse them.
    prefix_cache = False

    def decode_kwargs(self, cache: list, rows: list) -> dict:
        first = cache[0]
        keys = mx.arange(first._idx + 1)  # after this step's key is written
        real = keys[None, :] >= first.left_padding[:, None]
        return {"mask": real[:, None, None, :]}
