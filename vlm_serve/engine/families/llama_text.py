"""Models whose language model is Llama-shaped (LLaVA, Idefics3, SmolVLM, InternVL,
Mistral 3): nothing per request beyond the batch, and the engine's Llama-shaped decode
step."""

from __future__ import annotations

from ..decode.llama import LlamaDecoder
from .base import Family


class LlamaText(Family):
    name = "llama-text"
    decoder_class = LlamaDecoder
    # Prompts share prefill passes; each runs its own vision tower (no encode_images).
    batch_prefill = batch_prefill_images = True
    # Vision-side inputs get_input_embeddings passes on; the text model reads none.
    prefill_batch_axes = {"pixel_attention_mask": None, "num_patches_list": None,
                          "image_token_index": None}


class Mistral3(LlamaText):
    """Mistral 3 (Pixtral's Mistral text model: Llama-shaped). Its Ministral 3 (sliding
    windows, Llama 4 attention scaling) and Mistral 4 (mixture of experts) text models
    decode through the model code."""

    name = "mistral3"

    def __init__(self, model, vision_cache_size: int = 64):
        super().__init__(model, vision_cache_size)
        self.use_decoder = type(model.language_model.model).__name__ == "Mistral"
