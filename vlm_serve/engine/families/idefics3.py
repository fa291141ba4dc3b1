"""Idefics3 and SmolVLM: Llama-shaped text models (``LlamaText``) whose embedding the
engine replaces (``idefics3_embed``), so their images' features can be kept in the
vision cache and handed back: a resent image skips the tower."""

from __future__ import annotations

from .idefics3_embed import idefics3_features
from .llama_text import LlamaText


class Idefics3(LlamaText):
    name = "idefics3"

    def encode_images(self, input_ids, pixel_values, inputs):
        # The features the installed get_input_embeddings computes, and takes back as
        # ``cached_image_features``.
        return idefics3_features(self.model, pixel_values, inputs.get("pixel_attention_mask"))
