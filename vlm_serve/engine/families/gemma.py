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
    tower_stacks_images = True
    pad_last_prefill = True
    text_after_cached_images = True
    # attention_mask_4d (get_input_embeddings' padding mask) is not read by the text model.
    prefill_batch_axes = {"attention_mask_4d": None}

    def prefill_decoder(self, kwargs):
        # The text model reads only the embeddings, the caches and a mask if given.
        return self.decoder() if "mask" not in kwargs else None

    def encode_images(self, input_ids, pixel_values, inputs):
        # As Gemma 3's get_input_embeddings: pixels in the embedding dtype, channels last.
        dtype = self.model.language_model.model.embed_tokens(input_ids[:, :1]).dtype
        hidden, _, _ = self.model.vision_tower(
            pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True
        )
        return self.model.multi_modal_projector(hidden)

    def merge(self, input_ids, pixel_values, mask, inputs, features=None):
        """``get_input_embeddings``' merge without its read-back: the model finds its
        image positions with NumPy, which waits for every tower call and pass queued
        before it (a burst's prefill went tower by tower) and costs the host ~3 ms a
        prompt. Here each image token takes its feature row by a running count of
        image tokens, on the device. Same values: the model's merge only selects and
        copies (through float32, exact for the embedding dtype), as this does."""
        if features is None:  # text alone, or pixels with no key to cache their features by
            return super().merge(input_ids, pixel_values, mask, inputs, features)
        config = self.model.config
        embeds = self.model.language_model.model.embed_tokens(input_ids)
        scaled = features / (config.hidden_size**0.5)
        rows = scaled.reshape(-1, scaled.shape[-1])
        image = (input_ids == config.image_token_index).reshape(-1)
        pad = (input_ids == (config.pad_token_id or 0)).reshape(-1)
        # The k-th image token (in row-major order, as the model's scatter) takes row k.
        index = mx.clip(mx.cumsum(image.astype(mx.int32)) - 1, 0, rows.shape[0] - 1)
        text = embeds.reshape(-1, embeds.shape[-1])
        merged = mx.where(image[:, None], rows[index], mx.where(pad[:, None], 0, text).astype(mx.float32))
        merged = merged.astype(embeds.dtype).reshape(embeds.shape)
        # Not read by the text model, but part of the model's output.
        mask_4d = mx.expand_dims(mx.expand_dims(mask, 1) * mx.expand_dims(mask, 2), 1)
        return merged, {**inputs, "attention_mask_4d": mask_4d}

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
    # Image prompts prefill whole (bidirectional attention over image tokens). Their
    # pass still stacks exactly: the model builds each row's image overlay from that
    # row's own ``mm_token_type_ids`` (``_make_masks``); only whether the overlay is on
    # at all is decided for the whole pass, so it is part of the signature.
    batch_prefill = batch_prefill_images = batch_vision = True
    tower_stacks_images = True
    prefill_batch_axes = {"per_layer_inputs": 0, "mm_token_type_ids": 0}
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

    def batch_signature(self, kwargs: dict) -> tuple | None:
        signature = super().batch_signature(kwargs)
        types = kwargs.get("mm_token_type_ids")
        if signature is None or types is None:
            return signature
        # The model turns the image overlay on for every row when any row has image
        # tokens: rows share a pass only when each would decide the same alone.
        has_image = bool(mx.any((types == 1) | (types == 2)).item())
        return (*signature, ("has_image_tokens", has_image))

    def stack_image_inputs(self, inputs):
        # mm_token_type_ids rides with the pixels but is not a tower input.
        if any(set(i) - {"mm_token_type_ids"} != {"pixel_values"} for i in inputs):
            return None
        return {"pixel_values": mx.concatenate([i["pixel_values"] for i in inputs])}

    def split_image_features(self, features, inputs):
        # The tower returns all images' tokens in one row, image after image; images of
        # one bucket have one size, so each has the same share.
        counts = [i["pixel_values"].shape[0] for i in inputs]
        per_image = features.shape[1] // sum(counts)
        ends = list(itertools.accumulate(c * per_image for c in counts))
        return [features[:, a:b] for a, b in zip([0, *ends[:-1]], ends)]
