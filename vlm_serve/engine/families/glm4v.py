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
import numpy as np

from ..decode.glm4v import Glm4vDecoder
from . import glm4v_tower
from .qwen_vl import QwenVL


class Glm4V(QwenVL):
    name = "glm4v"
    decoder_class = Glm4vDecoder
    batch_prefill = batch_prefill_images = True  # passes shared
    # Each request's images get a tower call of their own: the tower's attention splits
    # its sequence after the first two images only, so a third image would attend with
    # the fourth (the model code's arithmetic, kept within one request as it is alone).
    batch_vision = False

    def __init__(self, model, *cache_bounds, **kwargs):
        super().__init__(model, *cache_bounds, **kwargs)
        glm4v_tower.install(model.vision_tower)

    def encode_images(self, input_ids, pixel_values, inputs):
        tower = self.model.vision_tower
        return tower(pixel_values.astype(tower.patch_embed.proj.weight.dtype), inputs.get("image_grid_thw"),
                     output_hidden_states=False)

    def merge(self, input_ids, pixel_values, mask, inputs, features=None):
        """``get_input_embeddings`` and ``get_rope_index`` without reading anything back
        from the device: ``QwenVL.merge``, every token kept (the model computes its
        positions without the mask); text alone, plain positions."""
        if features is None and pixel_values is not None and inputs.get("image_grid_thw") is not None:
            features = self.encode_images(input_ids, pixel_values, inputs)
        if features is not None:
            return super().merge(input_ids, None, mx.array(np.ones(input_ids.shape, np.int32)), inputs, features)
        length = input_ids.shape[1]
        positions = mx.broadcast_to(mx.arange(length)[None, None], (3, 1, length))
        return (self.model.language_model.model.embed_tokens(input_ids),
                {**inputs, "position_ids": positions, "rope_deltas": mx.zeros((1, 1), mx.int32)})

    def chunk_kwargs(self, kwargs: dict, start: int, stop: int) -> dict:
        return {**kwargs, "position_ids": kwargs["position_ids"][:, :, start:stop]}
