"""GLM-4V: mRoPE positions, which mlx-vlm keeps on the language model between calls.

mlx-vlm reads those positions back only for the first prefill chunk (later chunks of an
image prompt get plain text positions) and shares them between requests. Here every
request computes its own positions once, each prefill chunk gets its slice of them and
each decode step explicit ids, so the model-held state is never read. Decoding runs on
the engine's own step (``decode/glm4v.py``), each row at its token count plus its
``rope_delta`` (``QwenVL.rope_shift``).
"""

from __future__ import annotations

import mlx.core as mx

from ..decode.glm4v import Glm4vDecoder
from .qwen_vl import QwenVL


class Glm4V(QwenVL):
    name = "glm4v"
    decoder_class = Glm4vDecoder
    batch_prefill = batch_prefill_images = True  # passes shared; its tower runs per request
    batch_vision = False

    def encode_images(self, input_ids, pixel_values, inputs):
        return None  # get_input_embeddings takes no cached features

    def embed(self, input_ids, inputs, image_key=(), features=None):
        embeds, kwargs = super().embed(input_ids, inputs, image_key, features)
        grid = kwargs.get("image_grid_thw")
        if grid is not None:
            positions, delta = self.model.language_model.get_rope_index(input_ids, grid, None, None)
        else:
            positions = mx.broadcast_to(mx.arange(input_ids.shape[1])[None, None], (3, 1, input_ids.shape[1]))
            delta = mx.zeros((1, 1), mx.int32)
        kwargs["position_ids"] = positions
        kwargs["rope_deltas"] = delta
        return embeds, kwargs

    def chunk_kwargs(self, kwargs: dict, start: int, stop: int) -> dict:
        return {**kwargs, "position_ids": kwargs["position_ids"][:, :, start:stop]}
