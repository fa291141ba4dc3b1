"""Model-family quirks, in one place per family.

The batch generator is written against this small interface:

- ``embed``: input embeddings for one request (runs the vision tower when the request
  has images) plus the extra keyword arguments its prefill passes to the language
  model, exactly as mlx-vlm's own ``generate_step`` does.
- ``row_state``: what a row must remember for decoding in a batch (e.g. rope deltas).
- ``decode_kwargs``: extra language-model arguments for one batched decode step.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import mlx.core as mx

# Keys of ``get_input_embeddings`` output that are not language-model arguments.
_EMBED_ONLY_KEYS = {"inputs_embeds"}


class VisionCache:
    """Projected image features of recent requests, keyed by their images' digests, so a
    conversation that sends the same image every turn runs the vision tower once."""

    def __init__(self, size: int):
        self.size = size
        self._entries: OrderedDict[tuple, mx.array] = OrderedDict()
        self.hits = 0

    def get(self, key: tuple):
        features = self._entries.get(key)
        if features is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return features

    def put(self, key: tuple, features) -> None:
        if self.size <= 0:
            return
        self._entries[key] = features
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)


class ModelAdapter:
    def __init__(self, model, vision_cache_size: int = 64):
        self.model = model
        self.vision_cache = VisionCache(vision_cache_size)

    def encode_images(self, input_ids: mx.array, pixel_values, inputs: dict):
        """The projected image features ``get_input_embeddings`` would compute, for
        families that accept them back as ``cached_image_features``; None otherwise."""
        return None

    def embed(
        self, input_ids: mx.array, inputs: dict[str, mx.array], image_key: tuple = ()
    ) -> tuple[mx.array, dict]:
        inputs = dict(inputs)
        pixel_values = inputs.pop("pixel_values", None)
        mask = inputs.pop("attention_mask", None)
        if mask is None:
            mask = mx.ones(input_ids.shape, mx.int32)
        cached = {}
        if pixel_values is not None and image_key:
            features = self.vision_cache.get(image_key)
            if features is None:
                features = self.encode_images(input_ids, pixel_values, inputs)
                if features is not None:
                    self.vision_cache.put(image_key, features)
            if features is not None:
                cached["cached_image_features"] = features
        out = self.model.get_input_embeddings(input_ids, pixel_values, mask=mask, **inputs, **cached)
        kwargs = {**inputs}
        kwargs.update(
            {k: v for k, v in out.to_dict().items() if k not in _EMBED_ONLY_KEYS and v is not None}
        )
        return out.inputs_embeds, kwargs

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

    def row_state(self, prefill_kwargs: dict) -> dict[str, Any]:
        return {}

    def decode_kwargs(self, cache: list, rows: list[dict[str, Any]]) -> dict:
        return {}


class Gemma3Adapter(ModelAdapter):
    def encode_images(self, input_ids, pixel_values, inputs):
        # As Gemma 3's get_input_embeddings: pixels in the embedding dtype, channels last.
        dtype = self.model.language_model.model.embed_tokens(input_ids[:, :1]).dtype
        hidden, _, _ = self.model.vision_tower(
            pixel_values.transpose(0, 2, 3, 1).astype(dtype), output_hidden_states=True
        )
        return self.model.multi_modal_projector(hidden)


class Gemma4Adapter(ModelAdapter):
    def encode_images(self, input_ids, pixel_values, inputs):
        return self.model.encode_image(pixel_values, inputs.get("image_position_ids"))


class MRopeAdapter(ModelAdapter):
    """Qwen-VL: 3-axis rotary positions. After an image, a row's text positions run
    ``rope_delta`` behind its token count, so each row carries its own delta and the
    batch passes explicit position ids instead of relying on model-held state."""

    def encode_images(self, input_ids, pixel_values, inputs):
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        return self.model.vision_tower(
            pixel_values.astype(dtype), inputs.get("image_grid_thw"), output_hidden_states=False
        )

    def row_state(self, prefill_kwargs: dict) -> dict[str, Any]:
        delta = prefill_kwargs.get("rope_deltas")
        return {"rope_delta": int(delta.reshape(-1)[0].item()) if delta is not None else 0}

    def decode_kwargs(self, cache: list, rows: list[dict[str, Any]]) -> dict:
        offsets = mx.maximum(cache[0].offset, 0)
        deltas = mx.array([r["rope_delta"] for r in rows], mx.int32)
        positions = (offsets + deltas)[:, None]
        return {"position_ids": mx.broadcast_to(positions[None], (3, len(rows), 1))}


_ADAPTERS = {
    "gemma3": Gemma3Adapter,
    "gemma4": Gemma4Adapter,
    "qwen2_vl": MRopeAdapter,
    "qwen2_5_vl": MRopeAdapter,
}


def adapter_for(model, vision_cache_size: int = 64) -> ModelAdapter:
    model_type = getattr(model.config, "model_type", "")
    return _ADAPTERS.get(model_type, ModelAdapter)(model, vision_cache_size)
