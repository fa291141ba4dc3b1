"""Gemma 3 and Gemma 4: batched, each on its engine decode step (``decode/gemma3.py``,
``decode/gemma4.py``; Gemma 4's mixture-of-experts models on mlx-vlm's model code);
the vision tower's output is cached for repeated images."""

from __future__ import annotations

import itertools

import mlx.core as mx

from ..decode import Gemma3Decoder, Gemma4Decoder
from .base import Family


class Gemma3(Family):
    name = "gemma3"
    decoder_class = Gemma3Decoder
    batch_prefill = batch_prefill_images = batch_vision = True
    # attention_mask_4d (get_input_embeddings' padding mask) is not read by the text model.
    prefill_batch_axes = {"attention_mask_4d": None}

    def encode_images(self, input_ids, pixel_values, inputs):
        # As Gemma 3's get_input_embeddings: pixels in the embedding dtype, channels last.
        dtype = self.model.language_model.model.embed_tokens(input_ids[:, :1]).dtype
        hidden, _, _ = self.model.vision_tower(
            pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True
        )
        return self.model.multi_modal_projector(hidden)

    def stack_image_inputs(self, inputs):
        if any(set(i) != {"pixel_values"} for i in inputs):
            return None
        return {"pixel_values": mx.concatenate([i["pixel_values"] for i in inputs])}

    def split_image_features(self, features, inputs):
        # One row of features per image, in the requests' order.
        ends = list(itertools.accumulate(i["pixel_values"].shape[0] for i in inputs))
        return [features[a:b] for a, b in zip([0, *ends[:-1]], ends)]


class Gemma4(Family):
    name = "gemma4"
    decoder_class = Gemma4Decoder
    # Text prompts share prefill passes; image prompts (whole-prompt prefill with
    # bidirectional attention over image tokens, variable image sizes) stay alone.
    batch_prefill = True
    prefill_batch_axes = {"per_layer_inputs": 0}
    # Reusing an image prompt's prefix does not reproduce its tokens yet (its attention
    # over image tokens is bidirectional): image prompts are prefilled whole.
    image_prefix_cache = False

    def __init__(self, model, *cache_bounds, **kwargs):  # the vision cache's, as Family's
        super().__init__(model, *cache_bounds, **kwargs)
        if getattr(model.language_model.config, "enable_moe_block", False):
            # The mixture-of-experts models (26B A4B) have no engine step: their model
            # code batches them on mlx-lm's batch caches.
            self.decoder_class = None

    def encode_images(self, input_ids, pixel_values, inputs):
        return self.model.encode_image(pixel_values, inputs.get("image_position_ids"))
