"""Idefics3's (and SmolVLM's) ``get_input_embeddings`` with nothing read back from the
device.

The model code reads back which images are padding (the processor pads a batch's image
lists with images of zeros, and the model counts each image's zeros on the device), how
many rows and columns of patches each image's pixel mask covers (``int()`` in
``VisionEmbeddings``), and the image tokens' positions (``np.where`` in
``masked_scatter``). Each read waits for all the work queued before it. The pixels, the
pixel mask and the token ids are the processor's, host data: here the same numbers come
from them, and the model's own layers run as before (``tests/test_host_merge.py``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_vlm.models.base import InputEmbeddingsFeatures


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


def real_images(pixels: np.ndarray) -> np.ndarray:
    """Indices of the images (``pixels``' first axis) with any value other than 0.
    Idefics3's processor pads a batch's image lists with images of zeros, which its
    model code drops (it counts each image's zeros on the device and reads that back)."""
    return np.flatnonzero(pixels.reshape(pixels.shape[0], -1).any(axis=1)).astype(np.int64)


def _on_host(values: mx.array) -> np.ndarray:
    """``values`` as numpy: free for the processor's arrays, which the engine made from
    host data (bfloat16, which numpy lacks, goes through float32: exact)."""
    return np.asarray(values.astype(mx.float32) if values.dtype == mx.bfloat16 else values)


def _patch_embeddings(embeddings, x: mx.array, patch_mask: np.ndarray) -> mx.array:
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


def idefics3_features(model, pixel_values: mx.array, pixel_attention_mask) -> mx.array:
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
    hidden = _patch_embeddings(vision.embeddings, pixel_values.transpose(0, 2, 3, 1), patch_mask)
    hidden = hidden.astype(vision.embeddings.patch_embedding.weight.dtype)
    hidden, _ = vision.encoder(x=hidden, output_hidden_states=True, mask=None)
    features = model.connector(vision.post_layernorm(hidden).astype(pixel_values.dtype))
    return features.reshape(-1, features.shape[-1])


def idefics3_embeddings(model):
    """Idefics3's ``get_input_embeddings``: its steps, with the padding images, the
    patch counts and the image positions taken on the host."""
    def get_input_embeddings(input_ids=None, pixel_values=None, **kwargs):
        inputs_embeds = model.language_model.embed_tokens(input_ids)
        if pixel_values is None:
            return InputEmbeddingsFeatures(inputs_embeds=inputs_embeds)
        features = kwargs.get("cached_image_features")
        if features is None:
            features = idefics3_features(model, pixel_values, kwargs.get("pixel_attention_mask"))
        return InputEmbeddingsFeatures(inputs_embeds=scattered(
            inputs_embeds, features, np.asarray(input_ids), model.config.image_token_index))
    return get_input_embeddings
