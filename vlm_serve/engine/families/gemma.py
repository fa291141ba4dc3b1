"""Gemma 3 and Gemma 4: batched as they are (sliding windows come from their own
cache classes); the vision tower's output is cached for repeated images."""

from __future__ import annotations

from ..decode import Gemma3Decoder
from .base import Family


class Gemma3(Family):
    name = "gemma3"
    decoder_class = Gemma3Decoder

    def encode_images(self, input_ids, pixel_values, inputs):
        # As Gemma 3's get_input_embeddings: pixels in the embedding dtype, channels last.
        dtype = self.model.language_model.model.embed_tokens(input_ids[:, :1]).dtype
        hidden, _, _ = self.model.vision_tower(
            pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True
        )
        return self.model.multi_modal_projector(hidden)


class Gemma4(Family):
    name = "gemma4"
    # Reusing an image prompt's prefix does not reproduce its tokens yet (its attention
    # over image tokens is bidirectional): image prompts are prefilled whole.
    image_prefix_cache = False

    def encode_images(self, input_ids, pixel_values, inputs):
        return self.model.encode_image(pixel_values, inputs.get("image_position_ids"))
