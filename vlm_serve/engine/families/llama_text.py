"""Models whose language model is Llama-shaped (LLaVA, Idefics3, SmolVLM, InternVL):
nothing per request beyond the batch, and the engine's Llama-shaped decode step."""

from __future__ import annotations

from ..decode.llama import LlamaDecoder
from .base import Family


class LlamaText(Family):
    name = "llama-text"
    decoder_class = LlamaDecoder
