"""Image features into a prompt's embeddings with the image positions found on the host.

mlx-vlm's merges find a prompt's image tokens by reading device arrays back
(``.item()``, ``np.where`` on a comparison the device computes). Every such read waits
for all the work queued before it, so under load each prompt's embedding waits for the
tower calls and passes of the prompts before it, and the device idles while the host
builds the next. The prompt's token ids are on the host already (``Prefill.materialize``
builds them there): these merges take the positions from them and leave only the
gather or scatter to the device. The values are the model code's: the merges only
select and copy rows, as these do (``tests/test_host_merge.py``).

Idefics3 and SmolVLM also read back which images are padding and how many patches each
image's pixel mask covers: their whole embedding is replaced (``idefics3_embed``).
Kimi-VL's merge reads nothing back, but its tower reads each image's grid shape: it is
handed them as host numbers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .idefics3_embed import idefics3_embeddings


def gathered(embeds: mx.array, features: mx.array, tokens: np.ndarray, image_token: int,
             video_token: int | None = None) -> mx.array:
    """Each row's image tokens (or, where the prompt has none and ``video_token`` is
    given, its video tokens) take the next feature rows in order, the rest keep
    ``embeds``: Qwen2-VL's and Mistral 3's ``merge_input_ids_with_image_features``."""
    positions = tokens == image_token
    if video_token is not None and not positions.any():
        positions = tokens == video_token
    rows, start = [], 0
    for row, mask in enumerate(positions):
        count = int(mask.sum())
        if count == 0:
            rows.append(embeds[row])
            continue
        if features.shape[0] < start + count:
            raise ValueError(f"Number of image token positions ({count}) does not match number of image "
                             f"features ({max(0, features.shape[0] - start)}) for batch {row}")
        index = np.where(mask, np.cumsum(mask) - 1, 0) + start
        rows.append(mx.where(mx.array(mask)[:, None], features[mx.array(index, mx.int32)], embeds[row]))
        start += count
    return mx.stack(rows)


def _llava_merge(model):
    def merge(image_features, inputs_embeds, input_ids):
        columns = np.where(np.asarray(input_ids) == model.config.image_token_index)[1].tolist()
        features = image_features.reshape(-1, image_features.shape[-1]).astype(inputs_embeds.dtype)
        if features.shape[0] > len(columns):
            raise ValueError("Llava model supports only one image per input. Please check your input_ids "
                             "and pixel_values.")
        inputs_embeds[:, columns, :] = features
        return inputs_embeds
    return merge


def _internvl_merge(model):
    def merge(image_features, inputs_embeds, input_ids, image_token_index=None):
        tokens = np.asarray(input_ids)
        token = model.config.image_token_index if image_token_index is None else image_token_index
        positions = tokens == np.asarray(token)
        if not positions.any():
            positions = tokens == model.config.video_token_index
        columns = np.where(positions)[1].tolist()
        inputs_embeds[:, columns, :] = image_features.reshape(-1, image_features.shape[-1])
        return inputs_embeds
    return merge


def _mistral3_merge(image_token_index, image_features, inputs_embeds, input_ids):
    if image_features.ndim == 3 and image_features.shape[0] == 1:
        image_features = image_features.squeeze(0)
    return gathered(inputs_embeds, image_features, np.asarray(input_ids), image_token_index)


def _block_mask(patch_embeds_list, tensor):
    """Pixtral's ``generate_block_attention_mask`` (Mistral 3's tower), its images'
    blocks bounded by sums on the host instead of on the device (which it reads back)."""
    seq_len = tensor.shape[1]
    mask = mx.full((seq_len, seq_len), vals=-1e9)
    ends = np.cumsum(patch_embeds_list)
    for start, end in zip((ends - np.asarray(patch_embeds_list)).tolist(), ends.tolist()):
        mask[start:end, start:end] = 0
    mask = mx.broadcast_to(mask[None, None, :, :], (tensor.shape[0], 1, seq_len, seq_len))
    return mask.astype(tensor.dtype)


def _install_block_mask() -> None:
    from mlx_vlm.models.pixtral import vision  # the module's function, for every Pixtral tower: same values

    if vision.generate_block_attention_mask is not _block_mask:
        _block_mask.original = vision.generate_block_attention_mask
        vision.generate_block_attention_mask = _block_mask


def host_grid_shapes(grid_shapes, grids: mx.array) -> list[tuple[int, int]]:
    """Each image's (rows, columns) of patches as host numbers: from the processor's
    ``_grid_shapes`` (which the engine hands as arrays, one per image) where given,
    else from its grid array."""
    rows = np.asarray(grids) if grid_shapes is None else [np.asarray(shape) for shape in grid_shapes]
    return [(int(h), int(w)) for h, w in rows]


def _kimi_vl_embeddings(model):
    """Kimi-VL's ``get_input_embeddings`` with its images' grid shapes as host numbers:
    its tower (position embeddings, rotary table, patch merger) reads each shape with
    ``int``, and from an array each such read waits. Its merge reads nothing back."""
    original = type(model).get_input_embeddings.__get__(model)

    def get_input_embeddings(input_ids=None, pixel_values=None, **kwargs):
        grids = kwargs.get("image_grid_hws")
        grids = kwargs.get("video_grid_hws") if grids is None else grids
        if pixel_values is not None and grids is not None:
            kwargs["_grid_shapes"] = host_grid_shapes(kwargs.get("_grid_shapes"), grids)
        return original(input_ids, pixel_values, **kwargs)
    return get_input_embeddings


# model type -> (the model's method that reads back, its replacement's builder)
_MERGES = {
    "llava": ("_merge_input_ids_with_image_features", _llava_merge),
    "internvl_chat": ("_merge_input_ids_with_image_features", _internvl_merge),
    "mistral3": ("merge_input_ids_with_image_features", lambda model: _mistral3_merge),
    # Idefics3's reads run through the whole method (padding images, patch counts, merge)
    "idefics3": ("get_input_embeddings", idefics3_embeddings),
    "smolvlm": ("get_input_embeddings", idefics3_embeddings),
    "kimi_vl": ("get_input_embeddings", _kimi_vl_embeddings),  # (its tower's reads)
}


def install(model) -> bool:
    """Point ``model``'s merge (Idefics3's and Kimi-VL's: their whole embedding) at the
    host-position one, on this instance, where its model type has one; returns whether
    it did. On the instance, it stays when the model is served one row at a time."""
    model_type = str(getattr(model.config, "model_type", ""))
    entry = _MERGES.get(model_type)
    if entry is None or not hasattr(model, entry[0]):
        return False
    name, build = entry
    setattr(model, name, build(model))
    if model_type == "mistral3":
        _install_block_mask()  # its Pixtral tower reads its images' bounds back too
    return True
