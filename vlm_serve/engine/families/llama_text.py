"""Models whose language model is Llama-shaped (LLaVA, Idefics3, SmolVLM, InternVL,
Mistral 3): nothing per request beyond the batch, and the engine's Llama-shaped decode
step (Ministral 3 text models: its subclass)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from ..decode.llama import LlamaDecoder
from ..decode.ministral3 import Ministral3Decoder
from . import host_merge
from .base import Family


class LlamaText(Family):
    name = "llama-text"
    decoder_class = LlamaDecoder
    # Prompts share prefill passes; each runs its own vision tower (no encode_images but
    # Idefics3's, whose embedding the engine replaces).
    batch_prefill = batch_prefill_images = True
    # Their model code reads only the embeddings and the caches (no argument along the
    # tokens; rotary positions and Ministral 3's query scale from the cache offset, the
    # same for every row), so a right-padded last pass is exact.
    pad_last_prefill = True
    text_after_cached_images = True  # (for the same reason)
    # Vision-side inputs get_input_embeddings passes on; the text model reads none.
    prefill_batch_axes = {"pixel_attention_mask": None, "num_patches_list": None,
                          "image_token_index": None}

    def __init__(self, model, *cache_bounds, **kwargs):  # the vision cache's, as Family's
        super().__init__(model, *cache_bounds, **kwargs)
        host_merge.install(model)  # image positions (and Idefics3's padding images) from the host


class Mistral3(LlamaText):
    """Mistral 3 (and Magistral): Pixtral's Mistral text model takes the Llama-shaped
    step; a Ministral 3 text model (sliding windows, Llama 4 attention scaling) its own.

    mlx-vlm's Ministral 3 and Mistral 4 (mixture of experts) text models scale every
    row's queries by the first row's position when decoding a batch cache, so their
    model code is never batched: Ministral 3 is batched only on its engine step, and
    Mistral 4, which has none, is served one row at a time."""

    name = "mistral3"

    def __init__(self, model, *cache_bounds, **kwargs):  # the vision cache's, as Family's
        super().__init__(model, *cache_bounds, **kwargs)
        text = type(model.language_model.model).__name__
        self.decoder_class = _DECODERS.get(text)
        # No fixture proves a padded pass of Mistral 4's text model (mixture of experts).
        self.pad_last_prefill = text in ("Mistral", "Ministral3")
        params = getattr(model.language_model.config, "rope_parameters", None) or {}
        if text != "Mistral" and params.get("llama_4_scaling_beta"):
            # The decoder is not built here: on CUDA the row-exact matmul must be in the
            # layers before the step fuses them (``families.family_for``).
            self.model_code_inexact = (f"its {text} text model scales queries by position, "
                                       "and mlx-vlm's code gives a batch the first row's")

    def merge(self, input_ids, pixel_values, mask, inputs, features=None):
        # The image sizes as host numbers: the tower and the patch merger read each one
        # with ``.item()``/``.tolist()``, which would wait for all queued device work.
        sizes = inputs.get("image_sizes")
        if isinstance(sizes, mx.array):
            host = [tuple(int(v) for v in size) for size in np.asarray(sizes)]
            embeds, kwargs = super().merge(input_ids, pixel_values, mask, {**inputs, "image_sizes": host}, features)
            return embeds, {**kwargs, "image_sizes": sizes}
        return super().merge(input_ids, pixel_values, mask, inputs, features)


# Text model class -> its engine decode step.
_DECODERS = {"Mistral": LlamaDecoder, "Ministral3": Ministral3Decoder}
