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
from . import qwen3_tower, qwen_tower
from .base import Family
from .host_merge import gathered


class QwenVL(Family):
    name = "qwen-vl"
    decoder_class = Qwen2Decoder
    batch_prefill = batch_prefill_images = batch_vision = True
    # position_ids: (1, L) for text, (3, 1, L) with images; the grid is only read where
    # position_ids are not given.
    prefill_batch_axes = {"position_ids": -2, "rope_deltas": 0, "image_grid_thw": None}

    def __init__(self, model, *cache_bounds, **kwargs):  # the vision cache's, as Family's
        super().__init__(model, *cache_bounds, **kwargs)
        qwen_tower.install(model.vision_tower)  # Qwen2-VL's and Qwen2.5-VL's (not Qwen3-VL's)

    def encode_images(self, input_ids, pixel_values, inputs):
        dtype = self.model.vision_tower.patch_embed.proj.weight.dtype
        return self.model.vision_tower(
            pixel_values.astype(dtype), inputs.get("image_grid_thw"), output_hidden_states=False
        )

    def stack_image_inputs(self, inputs):
        if any(set(i) != {"pixel_values", "image_grid_thw"} for i in inputs):
            return None
        # The tower takes every image's patches in one sequence, split by the grids (on
        # the host, where the tower reads them: ``qwen_tower``).
        return {"pixel_values": mx.concatenate([i["pixel_values"] for i in inputs]),
                "image_grid_thw": mx.array(np.concatenate([np.asarray(i["image_grid_thw"]) for i in inputs]))}

    def split_image_features(self, features, inputs):
        # Each image's patches merge into a fixed share of feature rows.
        patches = [i["pixel_values"].shape[0] for i in inputs]
        per_patch = features.shape[0] / sum(patches)
        ends = list(itertools.accumulate(round(p * per_patch) for p in patches))
        return [features[a:b] for a, b in zip([0, *ends[:-1]], ends)]

    def merge(self, input_ids, pixel_values, mask, inputs, features=None):
        """``get_input_embeddings`` without reading anything back from the device.

        The model finds its image rows and its mRoPE positions with ``.item()`` and
        ``.tolist()`` on arrays the device computes, and each such read waits for every
        tower call and pass queued before it: a burst's prompts then embed one at a
        time behind the device. Here the positions come from the prompt's token ids on
        the host (``rope_index``, the model's arithmetic) and each image token takes its
        feature row by a gather. Same values: positions are integers, and the model's
        merge only selects rows, as this does."""
        if features is None and pixel_values is not None:  # the tower runs in the model code
            return super().merge(input_ids, pixel_values, mask, inputs, features)
        tokens, keep = np.asarray(input_ids), np.asarray(mask)
        embeds = self.model.language_model.model.embed_tokens(input_ids)
        if features is None:  # text alone
            positions = np.cumsum(keep.astype(np.int64), axis=-1) - 1
            positions = np.where(keep == 0, 1, positions)
            deltas = positions.max(axis=-1, keepdims=True) + 1 - keep.shape[-1]
            return embeds, {**inputs, "position_ids": mx.array(positions), "rope_deltas": mx.array(deltas)}
        config = self.model.config
        grids = {name: np.asarray(inputs[name]) if inputs.get(name) is not None else None
                 for name in ("image_grid_thw", "video_grid_thw")}
        positions, deltas = rope_index(tokens, keep, grids["image_grid_thw"], grids["video_grid_thw"], config)
        merged = gathered(embeds, features, tokens, config.image_token_id, config.video_token_id)
        return merged, {**inputs, "position_ids": mx.array(positions, dtype=input_ids.dtype),
                        "rope_deltas": mx.array(np.array(deltas, np.int32).reshape(-1, 1))}

    def chunk_kwargs(self, kwargs: dict, start: int, stop: int) -> dict:
        # The chunk's own positions (the model would slice them by the cache offset
        # itself): prompts of different lengths then share a pass's arguments.
        positions = kwargs.get("position_ids")
        if positions is None:
            return kwargs
        return {**kwargs, "position_ids": positions[..., start:stop]}

    def row_state(self, prefill_kwargs: dict, last_output) -> dict[str, Any]:
        delta = prefill_kwargs.get("rope_deltas")
        # Through NumPy: a device op on the deltas (even a reshape) would be read back
        # only after all the work queued before it.
        return {"rope_delta": int(np.asarray(delta).reshape(-1)[0]) if delta is not None else 0}

    def decode_kwargs(self, cache: list, rows: list[dict[str, Any]]) -> dict:
        offsets = mx.maximum(cache[0].offset, 0)
        deltas = mx.array([r["rope_delta"] for r in rows], mx.int32)
        positions = (offsets + deltas)[:, None]
        return {"position_ids": mx.broadcast_to(positions[None], (3, len(rows), 1))}

    def rope_shift(self, row: dict[str, Any]) -> int:
        return row["rope_delta"]


class Qwen3VL(QwenVL):
    """Qwen3-VL: mRoPE as Qwen2.5-VL, plus DeepStack image features added to the first
    layers' hidden states at image positions during prefill. Its features are the
    tower's two outputs, (merged features, DeepStack features by layer): the vision
    cache keeps both and the merge takes both back (mlx-vlm's own merge would drop the
    DeepStack features of cached ones). Decoding needs none of that (its text model is
    Qwen2's with q/k RMSNorm): the same decode step.

    Each chunk gets its own share of the DeepStack features (``chunk_kwargs``), so rows
    stack: the model adds a batch's features row after row, each row's by its own
    ``visual_pos_masks`` (``_deepstack_process``), exactly as it adds one row's alone."""

    name = "qwen3-vl"
    prefill_batch_axes = {**QwenVL.prefill_batch_axes, "visual_pos_masks": 0}

    def __init__(self, model, *cache_bounds, **kwargs):
        super().__init__(model, *cache_bounds, **kwargs)
        qwen3_tower.install(model.vision_tower)

    def encode_images(self, input_ids, pixel_values, inputs):
        if inputs.get("pixel_values_videos") is not None:
            return None  # the model code's merge (below)
        tower = self.model.vision_tower
        features, deepstack = tower(pixel_values.astype(tower.patch_embed.proj.weight.dtype),
                                    inputs.get("image_grid_thw"))
        return features, list(deepstack)

    def split_image_features(self, features, inputs):
        merged, deepstack = features
        split = super().split_image_features  # each layer's rows split as the features'
        by_layer = [split(layer, inputs) for layer in deepstack]
        return [(own, list(layers)) for own, layers in zip(split(merged, inputs), zip(*by_layer))]

    def merge(self, input_ids, pixel_values, mask, inputs, features=None):
        """``get_input_embeddings`` without reading anything back (``QwenVL.merge``):
        the tower's features by a gather, its DeepStack features as they come (one
        row per image position, in order), and the image positions from the host's
        token ids. Videos keep the model code (its positions split a video's frames)."""
        if features is None and pixel_values is not None:
            features = self.encode_images(input_ids, pixel_values, inputs)
            if features is None:
                return Family.merge(self, input_ids, pixel_values, mask, inputs)
        if features is None:  # text alone
            return super().merge(input_ids, None, mask, inputs)
        merged, deepstack = features
        embeds, kwargs = super().merge(input_ids, None, mask, inputs, merged)
        config = self.model.config
        visual = np.isin(np.asarray(input_ids), [config.image_token_id, config.video_token_id])
        return embeds, {**kwargs, "visual_pos_masks": mx.array(visual), "deepstack_visual_embeds": deepstack}

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
            # (The mask through NumPy first: a device slice of it would be read back only
            # after all the work queued before it.)
            counts = np.cumsum(np.asarray(visual)[0], dtype=np.int64)
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


def rope_index(tokens: np.ndarray, keep: np.ndarray, image_grid: np.ndarray | None,
               video_grid: np.ndarray | None, config) -> tuple[np.ndarray, list[int]]:
    """The 3-axis positions (3, rows, L) and each row's ``rope_delta`` of Qwen2-VL's
    ``get_rope_index``, on the host: the model's arithmetic on the token ids, the mask
    (``keep``: 1 for a real token) and the images' and videos' (t, h, w) grids."""
    vision = config.vision_config
    merge = vision.spatial_merge_size
    image_token, video_token = config.image_token_id, config.video_token_id
    start_token = config.vision_start_token_id
    positions = np.ones((3, *tokens.shape), np.int64)
    deltas, image_index, video_index = [], 0, 0
    for row, (ids, row_keep) in enumerate(zip(tokens.tolist(), keep.tolist())):
        kept = [t for t, k in zip(ids, row_keep) if k == 1]
        after_starts = [kept[i + 1] for i, t in enumerate(kept[:-1]) if t == start_token]
        images, videos = after_starts.count(image_token), after_starts.count(video_token)
        parts, st = [], 0

        def next_start():
            return int(parts[-1].max()) + 1 if parts else 0

        for _ in range(images + videos):
            ed_image = kept.index(image_token, st) if image_token in kept and images > 0 else len(kept) + 1
            ed_video = kept.index(video_token, st) if video_token in kept and videos > 0 else len(kept) + 1
            if ed_image < ed_video:
                t, h, w = (int(v) for v in image_grid[image_index])
                image_index, images, ed = image_index + 1, images - 1, ed_image
            else:
                t, h, w = (int(v) for v in video_grid[video_index])
                video_index, videos, ed = video_index + 1, videos - 1, ed_video
            h, w = h // merge, w // merge
            text, base = ed - st, next_start()
            parts.append(np.broadcast_to(np.arange(text), (3, text)) + base)
            grid = np.stack([np.repeat(np.arange(t), h * w), np.tile(np.repeat(np.arange(h), w), t),
                             np.tile(np.arange(w), t * h)])
            parts.append(grid + text + base)
            st = ed + t * h * w
        if st < len(kept):
            text, base = len(kept) - st, next_start()
            parts.append(np.broadcast_to(np.arange(text), (3, text)) + base)
        if not parts:
            deltas.append(0)
            continue
        compact = np.concatenate(parts, axis=1)
        columns = np.flatnonzero(np.asarray(row_keep) == 1)
        positions[:, row, columns] = compact
        deltas.append(int(compact.max()) + 1 - len(kept))
    return positions, deltas
