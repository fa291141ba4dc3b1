"""Image features into a prompt's embeddings with the image positions found on the host.

mlx-vlm's merges find a prompt's image tokens by reading device arrays back
(``.item()``, ``np.where`` on a comparison the device computes). Every such read waits
for all the work queued before it, so under load each prompt's embedding waits for the
tower calls and passes of the prompts before it, and the device idles while the host
builds the next. The prompt's token ids are on the host already (``Prefill.materialize``
builds them there): these merges take the positions from them and leave only the
gather or scatter to the device. The values are the model code's: the merges only
select and copy rows, as these do (``tests/test_host_merge.py``).

Idefics3 and SmolVLM also read back which images are padding (all zeros) and how many
patch rows and columns each image's pixel mask covers: both come from the processor's
arrays, which are host data too, so their embedding runs the same steps with those
numbers taken on the host. Kimi-VL's merge reads nothing back, but its tower reads each
image's grid shape: it is handed them as host numbers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_vlm.models.base import InputEmbeddingsFeatures


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


def scattered(embeds: mx.array, features: mx.array, tokens: np.ndarray, image_token: int) -> mx.array:
    """The image tokens of all rows, in order, take ``features``' values, the rest keep
    ``embeds``: Idefics3's ``masked_scatter``."""
    positions = np.flatnonzero(tokens == image_token)
    hidden = embeds.shape[-1]
    if positions.size * hidden != features.size:
        raise ValueError(f"Image features and image tokens do not match: tokens: {positions.size}, "
                         f"features {features.shape[0]}")
    rows = embeds.reshape(-1, hidden)
    rows[mx.array(positions, mx.uint32)] = features.reshape(-1, hidden)
    return rows.reshape(embeds.shape)


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


def real_images(pixels: np.ndarray) -> np.ndarray:
    """Indices of the images (``pixels``' first axis) with any value other than 0.
    Idefics3's processor pads a batch's image lists with images of zeros, which its
    model code drops (it counts each image's zeros on the device and reads that back)."""
    return np.flatnonzero(pixels.reshape(pixels.shape[0], -1).any(axis=1)).astype(np.int64)


def _on_host(values: mx.array) -> np.ndarray:
    """``values`` as numpy: free for the processor's arrays, which the engine made from
    host data (bfloat16, which numpy lacks, goes through float32: exact)."""
    return np.asarray(values.astype(mx.float32) if values.dtype == mx.bfloat16 else values)


def _idefics3_patch_embeddings(embeddings, x: mx.array, patch_mask: np.ndarray) -> mx.array:
    """Idefics3's ``VisionEmbeddings`` (the patches and their position embeddings), each
    image's rows and columns of valid patches counted on the host from ``patch_mask``
    (images x rows x columns); the model code counts them on the device and reads each
    image's back with ``int``."""
    batch_size = x.shape[0]
    patches = mx.flatten(embeddings.patch_embedding(x), start_axis=1, end_axis=2)
    seq_len = patches.shape[1]
    side = embeddings.num_patches_per_side
    boundaries = mx.arange(1 / side, 1.0, 1 / side)
    rows = np.maximum(patch_mask[:, :, 0].sum(axis=1), 1).tolist()
    columns = np.maximum(patch_mask[:, 0, :].sum(axis=1), 1).tolist()
    position_ids = mx.zeros((batch_size, seq_len), dtype=mx.int32)
    for image, (nb_h, nb_w) in enumerate(zip(rows, columns)):
        fractional_h = mx.clip(mx.arange(nb_h, dtype=mx.float32) / nb_h, a_min=0.0, a_max=1.0 - 1e-6)
        fractional_w = mx.clip(mx.arange(nb_w, dtype=mx.float32) / nb_w, a_min=0.0, a_max=1.0 - 1e-6)
        bucket_h = mx.sum(fractional_h[:, None] >= boundaries[None, :], axis=1)
        bucket_w = mx.sum(fractional_w[:, None] >= boundaries[None, :], axis=1)
        ids = (bucket_h[:, None] * side + bucket_w[None, :]).reshape(-1)
        valid = min(ids.shape[0], seq_len)
        position_ids[image, :valid] = ids[:valid]
    valid_patches = mx.array(patch_mask.reshape(batch_size, -1)[:, :seq_len])
    return patches + embeddings.position_embedding(position_ids) * valid_patches[:, :, None]


def _idefics3_features(model, pixel_values: mx.array, pixel_attention_mask) -> mx.array:
    """Idefics3's (and SmolVLM's) projected features of a prompt's real images, as its
    ``get_input_embeddings`` computes them, with the padding images and each image's
    patch mask found on the host (the processor's pixels and pixel mask)."""
    batch, images, channels, height, width = pixel_values.shape
    real = real_images(_on_host(pixel_values).reshape(batch * images, -1))
    pixel_values = pixel_values.reshape(batch * images, channels, height, width)[real.tolist(), ...]
    if pixel_attention_mask is None:
        pixel_mask = np.ones((len(real), height, width), np.bool_)
    else:
        pixel_mask = np.asarray(pixel_attention_mask).reshape(batch * images, height, width)[real]
    patch = model.config.vision_config.patch_size
    rows, columns = height // patch, width // patch
    patch_mask = (pixel_mask[:, :rows * patch, :columns * patch]
                  .reshape(len(real), rows, patch, columns, patch).sum(axis=(2, 4)) > 0)
    vision = model.vision_model  # its __call__, with the embeddings above
    hidden = _idefics3_patch_embeddings(vision.embeddings, pixel_values.transpose(0, 2, 3, 1), patch_mask)
    hidden = hidden.astype(vision.embeddings.patch_embedding.weight.dtype)
    hidden, _ = vision.encoder(x=hidden, output_hidden_states=True, mask=None)
    features = model.connector(vision.post_layernorm(hidden).astype(pixel_values.dtype))
    return features.reshape(-1, features.shape[-1])


def _idefics3_embeddings(model):
    """Idefics3's ``get_input_embeddings``: its steps, with the padding images, the
    patch counts and the image positions taken on the host."""
    def get_input_embeddings(input_ids=None, pixel_values=None, **kwargs):
        inputs_embeds = model.language_model.embed_tokens(input_ids)
        if pixel_values is None:
            return InputEmbeddingsFeatures(inputs_embeds=inputs_embeds)
        features = kwargs.get("cached_image_features")
        if features is None:
            features = _idefics3_features(model, pixel_values, kwargs.get("pixel_attention_mask"))
        return InputEmbeddingsFeatures(inputs_embeds=scattered(
            inputs_embeds, features, np.asarray(input_ids), model.config.image_token_index))
    return get_input_embeddings


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
    "idefics3": ("get_input_embeddings", _idefics3_embeddings),
    "smolvlm": ("get_input_embeddings", _idefics3_embeddings),
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
