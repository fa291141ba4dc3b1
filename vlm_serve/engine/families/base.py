"""The family interface, and the two families every model can fall back on.

A family is everything the engine must know about one kind of model. The scheduler,
prefill and batch are written against this interface only:

- ``embed``: input embeddings for one request (runs the vision tower when it has
  images) and the language-model arguments its prefill needs, as mlx-vlm's own
  ``generate_step`` computes them. Everything per request lives in what it returns,
  never on the model object.
- ``chunk_kwargs``: the arguments for one prefill chunk of the prompt.
- ``row_state``: what a row keeps for decoding (rope deltas, cross-attention states).
- ``decode_kwargs`` / ``after_step``: the arguments of one batched decode step, and what
  a step's output changes in the rows' state.

``Family`` is the plain case: rows batch with nothing beyond the batch caches.
``SerialFamily`` serves one row at a time, exactly as mlx-vlm's ``generate_step`` would:
the row keeps its own cache and carries the outputs mlx-vlm carries between steps. It is
correct by construction for any model mlx-vlm can generate with, so it is what an
unverified model type gets.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

from ..vision_cache import DEFAULT_MAX_BYTES as DEFAULT_VISION_CACHE_BYTES, VisionCache

log = logging.getLogger("vlm_serve.engine")

# Keys of ``get_input_embeddings`` output that are not language-model arguments.
_EMBED_ONLY_KEYS = {"inputs_embeds"}
# Config fields that name the image placeholder token, across mlx-vlm's models.
_IMAGE_TOKEN_FIELDS = ("image_token_index", "image_token_id", "media_placeholder_token_id")
# Language-model outputs that mlx-vlm's generate_step feeds to the next step.
_CARRIED_OUTPUTS = ("cross_attention_states", "encoder_outputs")


class Family:
    name = "generic"
    batched = True  # rows share one batched decode step
    prefix_cache = True  # prompts may start from a cached prefix
    image_prefix_cache = True  # ... prompts with images too (keyed by their digests)
    # A prompt whose images all lie in its cached prefix embeds only its text after it:
    # no pixels, no features. Only where a text token's embedding and the language
    # model's arguments do not depend on the images (no positions that run along them).
    text_after_cached_images = False
    # The engine-owned decode step (``engine/decode``), if the family has one; None:
    # decode through mlx-vlm's model code on mlx-lm's batch caches.
    decoder_class = None
    use_decoder = True  # off: always decode through mlx-vlm's model code (for comparison)
    # Why mlx-vlm's model code cannot decode a batch exactly, where it cannot: such a
    # family batches only on its engine decode step, and is served one row at a time
    # where none builds (``families.family_for`` decides, once the layers are final).
    model_code_inexact = ""
    # Prompts prefilled together (``prefill_batch``), each flag proven exact against
    # one-at-a-time prefill by the parity suite's burst cases; off: one by one.
    batch_prefill = False  # text prompts share the language model's passes
    batch_prefill_images = False  # ... image prompts too
    batch_vision = False  # images of several requests share one vision-tower call
    # A shared call stacks whole images of one shape (so its shape is its number of
    # images): on CUDA such calls are cut to checked sizes (``tower_sharing``).
    tower_stacks_images = False
    tower_sharing = None  # on CUDA, a ``TowerSharing``; None: any number share a call
    # Last passes of different lengths (within twice each other) share a pass, each
    # prompt's tokens first and padding after (causal attention never reads the
    # padding; it is trimmed from each cache after). Only with no argument that runs
    # along the tokens, and where no sliding window fills: proven exact per family by
    # the parity suite's burst cases.
    pad_last_prefill = False
    # The language-model arguments a shared pass stacks, and their batch axis (None:
    # the language model does not read it). A prompt with any other argument is
    # prefilled alone.
    prefill_batch_axes: dict[str, int | None] = {}

    def __init__(
        self, model, vision_cache_size: int = 64,
        vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES,
    ):
        self.model = model
        self.vision_cache = VisionCache(vision_cache_size, vision_cache_bytes)
        # The placeholder ids image features replace: prompts with images may use the
        # prefix cache only when these are known (they are marked in its keys).
        config = model.config
        self.image_token_ids = frozenset(
            v for v in (getattr(config, name, None) for name in _IMAGE_TOKEN_FIELDS)
            if isinstance(v, int)
        )

    def describe(self) -> str:
        path = "engine decode step" if self.decoder_class and self.use_decoder else "model code"
        return f"{self.name} family, batched decode ({path})"

    def decoder(self):
        """The family's decode step, built once (it fuses weights in place)."""
        if self.decoder_class is None or not self.use_decoder:
            return None
        if getattr(self, "_decoder", None) is None:
            try:
                self._decoder = self.decoder_class(self.model)
            except Exception:  # noqa: BLE001 - a model unlike its family's usual layout
                log.warning("%s: no engine decode step for this model, using its model code",
                            self.name, exc_info=True)
                self.use_decoder = False
                return None
        return self._decoder

    def encode_images(self, input_ids: mx.array, pixel_values, inputs: dict):
        """The projected image features ``get_input_embeddings`` would compute, for
        families that accept them back as ``cached_image_features``; None otherwise."""
        return None

    def cached_features(self, image_key: tuple):
        """The vision cache's features for these images, or None."""
        return self.vision_cache.get(image_key) if image_key else None

    def embed(
        self, input_ids: mx.array, inputs: dict[str, mx.array], image_key: tuple = (),
        features=None,
    ) -> tuple[mx.array, dict]:
        """``features``: the images' projected features, already computed (from the
        vision cache or a shared tower call); the pixels may then be left out."""
        inputs = dict(inputs)
        pixel_values = inputs.pop("pixel_values", None)
        mask = inputs.pop("attention_mask", None)
        if mask is None:  # on the host, so that reading it back waits for nothing
            mask = mx.array(np.ones(input_ids.shape, np.int32))
        if features is None and pixel_values is not None and image_key:
            features = self.vision_cache.get(image_key)
            if features is None:
                features = self.encode_images(input_ids, pixel_values, inputs)
                if features is not None:
                    self.vision_cache.put(image_key, features)
        return self.merge(input_ids, pixel_values, mask, inputs, features)

    def merge(self, input_ids: mx.array, pixel_values, mask: mx.array, inputs: dict,
              features=None) -> tuple[mx.array, dict]:
        """The prompt's embeddings with its images' ``features`` (or, where None, its
        pixels through the tower) in place, and the model's other outputs: as
        ``get_input_embeddings`` computes them. A family overrides this where the
        model's own merge reads a value back to the host, which waits for every
        queued tower call and pass (``Gemma3.merge``)."""
        cached = {}
        if features is not None:
            cached["cached_image_features"] = features
            if pixel_values is None:
                # The models test pixel_values for None before they look at cached
                # features; an empty stand-in is never read.
                pixel_values = mx.zeros((0,))
        out = self.model.get_input_embeddings(input_ids, pixel_values, mask=mask, **inputs, **cached)
        kwargs = {**inputs}
        kwargs.update(
            {k: v for k, v in out.to_dict().items() if k not in _EMBED_ONLY_KEYS and v is not None}
        )
        return out.inputs_embeds, kwargs

    # -- prefilling several prompts together (``prefill_batch``) ----------------------

    def stack_image_inputs(self, inputs: list[dict]) -> dict | None:
        """One vision-tower input for the images of several requests (each dict: a
        request's inputs), or None where they cannot share a call."""
        return None

    def split_image_features(self, features, inputs: list[dict]) -> list:
        """``encode_images`` output of stacked inputs, back to one value per request."""
        raise NotImplementedError

    def batch_signature(self, kwargs: dict) -> tuple | None:
        """Prompts share a language-model pass only with equal signatures (argument
        names and shapes but the batch axis); None: never shared."""
        sig = []
        for key, value in sorted(kwargs.items()):
            if key not in self.prefill_batch_axes:
                return None
            axis = self.prefill_batch_axes[key]
            if axis is None:
                continue
            if not isinstance(value, mx.array):
                return None
            shape = list(value.shape)
            del shape[axis]
            sig.append((key, value.ndim, tuple(shape), value.dtype))
        return tuple(sig)

    def stack_chunk_kwargs(self, per_row: list[dict]) -> dict:
        """The arguments of one shared prefill pass, from each prompt's chunk_kwargs."""
        out = {}
        for key, axis in self.prefill_batch_axes.items():
            if axis is not None and key in per_row[0]:
                out[key] = mx.concatenate([kw[key] for kw in per_row], axis=axis)
        return out

    def can_chunk_prefill(self, input_ids, embeds, cache, kwargs: dict) -> bool:
        """Whether this prompt may be prefilled in pieces. Some models need the whole
        prompt at once (e.g. Gemma 4 with bidirectional attention over image tokens);
        they say so through ``chunked_prefill_policy`` or ``no_chunked_prefill``."""
        candidates = [self.model, self.model.language_model]
        for candidate in candidates:
            policy = getattr(candidate, "chunked_prefill_policy", None)
            if callable(policy):
                return bool(
                    policy(
                        input_ids=input_ids,
                        inputs_embeds=embeds,
                        prompt_cache=cache,
                        draft_model=None,
                        draft_kind=None,
                        prefill_kwargs=kwargs,
                    )
                )
        return not any(getattr(c, "no_chunked_prefill", False) for c in candidates)

    def chunk_kwargs(self, kwargs: dict, start: int, stop: int) -> dict:
        """Arguments for prefilling prompt positions ``[start, stop)``. By default the
        whole prompt's, as mlx-vlm's generate passes them (models slice position
        metadata by the cache offset themselves)."""
        return kwargs

    def prefill_decoder(self, kwargs: dict):
        """The decoder whose own prefill pass (``prefill``, ``head_of``) runs a pass
        with these language-model arguments, or None: the model code runs it."""
        return None

    def row_state(self, prefill_kwargs: dict, last_output) -> dict[str, Any]:
        return {}

    def decode_kwargs(self, cache: list, rows: list[dict[str, Any]]) -> dict:
        return {}

    def rope_shift(self, row: dict[str, Any]) -> int:
        """How far a row's rotary position runs from its token count (engine decode
        step only)."""
        return 0

    def after_step(self, output, rows: list[dict[str, Any]]) -> None:
        """Update the rows' state from a decode step's language-model output."""


class SerialFamily(Family):
    """One row at a time, mirroring mlx-vlm's ``generate_step``: the row decodes on its
    own prompt cache and gets whatever mlx-vlm carries from one step to the next."""

    name = "serial"
    batched = False
    prefix_cache = False
    reason = "not verified for batched decoding"

    def __init__(
        self, model, vision_cache_size: int = 64,
        vision_cache_bytes: int = DEFAULT_VISION_CACHE_BYTES, reason: str | None = None,
    ):
        super().__init__(model, vision_cache_size, vision_cache_bytes)
        if reason:
            self.reason = reason

    def describe(self) -> str:
        return f"one request at a time ({self.reason})"

    def row_state(self, prefill_kwargs: dict, last_output) -> dict[str, Any]:
        return {"carry": _carried(last_output)}

    def decode_kwargs(self, cache: list, rows: list[dict[str, Any]]) -> dict:
        return dict(rows[0]["carry"]) if rows else {}

    def after_step(self, output, rows: list[dict[str, Any]]) -> None:
        if rows:
            rows[0]["carry"] = _carried(output)


def _carried(output) -> dict:
    for key in _CARRIED_OUTPUTS:
        value = getattr(output, key, None)
        if value is not None:
            return {key: value}
    return {}
