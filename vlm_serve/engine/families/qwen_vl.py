"""Qwen-VL (Qwen2-VL, Qwen2.5-VL): 3-axis rotary positions (mRoPE).

After an image, a row's text positions run ``rope_delta`` behind its token count. mlx-vlm
keeps the delta on the language model between calls; here each row carries its own and
every decode step passes explicit position ids, so rows never read each other's.
"""

from __future__ import annotations

import itertools
from typing import Any

import mlx.core as mx
import numpy as np

from ..decode.qwen2 import Qwen2Decoder
from .base import Family


class QwenVL(Family):
    name = "qwen-vl"
    decoder_class = Qwen2Decoder
    batch_prefill = batch_prefill_images = batch_vision = True
    # position_ids: (1, L) for text, (3, 1, L) with images; the grid is only read where
    # position_ids are not given.
    prefill_batch_axes = {"position_ids": -2, "rope_deltas": 0, "image_grid_thw": None}

    def __init__(self, model, *cache_bounds, **kwargs):  # the vision cache's, as Family's
        super().__init__(model, *cache_bounds, **kwargs)
        if hasattr(model.vision_tower, "get_window_index"):
            skip_empty_windows(model.vision_tower)

    def encode_images(self, input_ids, pixel_values, inputs):
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        return self.model.vision_tower(
            pixel_values.astype(dtype), inputs.get("image_grid_thw"), output_hidden_states=False
        )

    def stack_image_inputs(self, inputs):
        if any(set(i) != {"pixel_values", "image_grid_thw"} for i in inputs):
            return None
        # The tower takes every image's patches in one sequence, split by the grids.
        return {k: mx.concatenate([i[k] for i in inputs]) for k in ("pixel_values", "image_grid_thw")}

    def split_image_features(self, features, inputs):
        # Each image's patches merge into a fixed share of feature rows.
        patches = [i["pixel_values"].shape[0] for i in inputs]
        per_patch = features.shape[0] / sum(patches)
        ends = list(itertools.accumulate(round(p * per_patch) for p in patches))
        return [features[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def chunk_kwargs(self, kwargs: dict, start: int, stop: int) -> dict:
        # The chunk's own positions (the model would slice them by the cache offset
        # itself): prompts of different lengths then share a pass's arguments.
        positions = kwargs.get("position_ids")
        if positions is None:
            return kwargs
        return {**kwargs, "position_ids": positions[..., start:stop]}

    def row_state(self, prefill_kwargs: dict, last_output) -> dict[str, Any]:
        delta = prefill_kwargs.get("rope_deltas")
        return {"rope_delta": int(delta.reshape(-1)[0].item()) if delta is not None else 0}

    def decode_kwargs(self, cache: list, rows: list[dict[str, Any]]) -> dict:
        offsets = mx.maximum(cache[0].offset, 0)
        deltas = mx.array([r["rope_delta"] for r in rows], mx.int32)
        positions = (offsets + deltas)[:, None]
        return {"position_ids": mx.broadcast_to(positions[None], (3, len(rows), 1))}

    def rope_shift(self, row: dict[str, Any]) -> int:
        return row["rope_delta"]


class Qwen3VL(QwenVL):
    """Qwen3-VL: mRoPE as Qwen2.5-VL, plus DeepStack image features added to the first
    layers' hidden states at image positions during prefill. mlx-vlm drops the DeepStack
    features when given ``cached_image_features``, so the vision-feature cache stays off
    for this family: the tower runs for every request. Decoding needs none of that (its
    text model is Qwen2's with q/k RMSNorm): the same decode step.

    Each chunk gets its own share of the DeepStack features (``chunk_kwargs``), so rows
    stack: the model adds a batch's features row after row, each row's by its own
    ``visual_pos_masks`` (``_deepstack_process``), exactly as it adds one row's alone."""

    name = "qwen3-vl"
    batch_prefill_images = True
    batch_vision = False  # the tower's DeepStack outputs cannot be handed back cached
    prefill_batch_axes = {**QwenVL.prefill_batch_axes, "visual_pos_masks": 0}

    def encode_images(self, input_ids, pixel_values, inputs):
        return None

    def chunk_kwargs(self, kwargs: dict, start: int, stop: int) -> dict:
        kwargs = super().chunk_kwargs(kwargs, start, stop)
        visual = kwargs.get("visual_pos_masks")
        if visual is None:
            return kwargs
        kwargs = {**kwargs, "visual_pos_masks": visual[:, start:stop]}
        deepstack = kwargs.get("deepstack_visual_embeds")
        if deepstack is not None:
            # The features are one per image position of the prompt, in order: this
            # chunk's are those of the image positions in [start, stop), as the model
            # would select them itself by its cache offset.
            counts = np.cumsum(np.array(visual[0]), dtype=np.int64)
            a = int(counts[start - 1]) if start else 0
            b = int(counts[stop - 1]) if stop else 0
            kwargs["deepstack_visual_embeds"] = [layer[a:b] for layer in deepstack]
        return kwargs

    def batch_signature(self, kwargs: dict) -> tuple | None:
        deepstack = kwargs.get("deepstack_visual_embeds")
        rest = {k: v for k, v in kwargs.items() if k != "deepstack_visual_embeds"}
        signature = super().batch_signature(rest)
        if signature is None or deepstack is None:
            return signature
        # Rows hold different numbers of image positions: only the feature width counts.
        layers = tuple((tuple(layer.shape[1:]), layer.dtype) for layer in deepstack)
        return (*signature, ("deepstack_visual_embeds", layers))

    def stack_chunk_kwargs(self, per_row: list[dict]) -> dict:
        out = super().stack_chunk_kwargs(per_row)
        if "deepstack_visual_embeds" in per_row[0]:
            # Row after row: the model reads each row's back by its visual_pos_masks.
            per_layer = zip(*(kw["deepstack_visual_embeds"] for kw in per_row))
            out["deepstack_visual_embeds"] = [mx.concatenate(layer) for layer in per_layer]
        return out


def skip_empty_windows(vision_tower) -> None:
    """Qwen2.5-VL's window attention, without zero-length windows.

    ``get_window_index`` lists a window boundary once per padded window, so the same
    offset repeats; mlx-vlm means to drop the repeats, but compares ``mx.array`` scalars
    by identity, so none are dropped and attention runs on empty windows. On the CPU an
    empty window is harmless; with bf16 on CUDA it ends the process with SIGFPE. Dropping
    the repeats here changes no value: an empty window attends to nothing.
    """
    window_index = vision_tower.get_window_index

    def get_window_index(grid_thw):
        index, bounds = window_index(grid_thw)
        unique = sorted(set(bounds.tolist()))
        return index, mx.array(unique, dtype=bounds.dtype)

    vision_tower.get_window_index = get_window_index
