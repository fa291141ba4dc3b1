"""Model families: one module per family, and the registry that picks one for a model.

A model type is batched only once its family has passed the parity suite (batched
tokens equal mlx-vlm's single-request tokens). Any other model type is served one row
at a time, which is correct by construction, and the server says so at startup. On
CUDA a batched family also needs every linear layer of its language model on the
row-exact matmul (``row_exact``) and the engine's own decode step; a model without
either is served one row at a time too. So is one on a CPU whose preloaded BLAS gives
a row other bits batched than alone (``cpu_blas``).
"""

from __future__ import annotations

import logging

from .. import cpu_blas, row_exact, tower_sharing
from ..vision_cache import DEFAULT_MAX_BYTES as DEFAULT_VISION_CACHE_BYTES
from .base import Family, SerialFamily
from .gemma import Gemma3, Gemma4
from .glm4v import Glm4V
from .idefics3 import Idefics3
from .kimi_vl import KimiVL
from .llama_text import LlamaText, Mistral3
from .mllama import Mllama
from .paligemma import PaliGemma
from .phi3_v import Phi3V
from .qwen_vl import Qwen3VL, QwenVL

log = logging.getLogger("vlm_serve.engine")

# model_type -> family (a ``SerialFamily`` says why it is not batched).
# Keep in step with the README's table of families.
FAMILIES: dict[str, type[Family]] = {
    "gemma3": Gemma3,
    "gemma4": Gemma4,
    "qwen2_vl": QwenVL,
    "qwen2_5_vl": QwenVL,
    "qwen3_vl": Qwen3VL,
    "glm4v": Glm4V,
    "paligemma": PaliGemma,
    "mllama": Mllama,
    "phi3_v": Phi3V,
    # No per-request state beyond the batch caches: the plain family's batching.
    "kimi_vl": KimiVL,
    # ... and the engine's own decode step runs their Llama-shaped text models.
    "mistral3": Mistral3,
    "llava": LlamaText,
    "idefics3": Idefics3,
    "smolvlm": Idefics3,
    "internvl_chat": LlamaText,
}


def family_for(
    model, vision_cache_size: int = 64, vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES,
) -> Family:
    """The family of ``model``, its vision cache bounded by entries and bytes."""
    model_type = str(getattr(model.config, "model_type", ""))
    cls = FAMILIES.get(model_type)
    if cls is None:
        family = SerialFamily(
            model, vision_cache_size, vision_cache_bytes,
            reason=f"model type {model_type!r} is not verified for batched decoding",
        )
    else:
        family = cls(model, vision_cache_size, vision_cache_bytes)
    # A family whose model code cannot batch exactly needs its own step: where it has
    # none, it is served one row at a time (so on CUDA nothing is installed for it) ...
    if family.batched and family.model_code_inexact and family.decoder_class is None:
        family = SerialFamily(model, vision_cache_size, vision_cache_bytes,
                              reason=family.model_code_inexact)
    if family.batched and row_exact.applies():
        family = _row_exact(family, vision_cache_size, vision_cache_bytes)
    elif family.batched:
        # ... and on a CPU whose BLAS is not the one MLX bundles, where a check at load
        # finds a row's bits following the row count.
        reason = cpu_blas.inexact_reason(model.language_model)
        if reason:
            family = SerialFamily(model, vision_cache_size, vision_cache_bytes, reason=reason)
    # ... and so too where the step does not build (built here, after the row-exact
    # matmul went into the layers it fuses).
    if family.batched and family.model_code_inexact and family.decoder() is None:
        family = SerialFamily(model, vision_cache_size, vision_cache_bytes,
                              reason=family.model_code_inexact)
    report = log.info if family.batched else log.warning
    report("model type %s: %s", model_type or "?", family.describe())
    return family


def _row_exact(family: Family, vision_cache_size: int, vision_cache_bytes: int) -> Family:
    """``family`` with the row-exact matmul installed, its requests' images in tower
    calls of checked sizes (``tower_sharing``) or each in a call of their own; or one
    row at a time where a layer cannot take it, or
    where the model has no engine decode step (the model code's batched decode attends
    over left-padded caches with MLX's attention, whose sums follow the padded length),
    or one not yet seen exact on CUDA."""
    left = row_exact.install(family.model.language_model)
    reason = None
    decoder = None if left else family.decoder()
    if left:
        shown = ", ".join(left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
        reason = f"on CUDA, no row-exact matmul for {shown}"
    elif decoder is None:
        reason = "on CUDA, rows batch exactly only on the engine's own decode step, which this model has not"
    elif not decoder.exact_on_cuda:
        reason = f"on CUDA, batched rows of {type(decoder).__name__} have differed from the same rows alone"
    if reason:
        return SerialFamily(family.model, vision_cache_size, vision_cache_bytes, reason=reason)
    if family.batch_vision and family.tower_stacks_images and tower_sharing.ENABLED:
        family.tower_sharing = tower_sharing.TowerSharing(family)
        towers = "one-image requests share vision-tower calls of checked sizes"
    else:
        family.batch_vision = False
        towers = "each request's images get a vision-tower call of their own"
    log.info("CUDA: the language model's linear layers run on the row-exact matmul; %s", towers)
    return family


__all__ = ["FAMILIES", "Family", "SerialFamily", "family_for"]
