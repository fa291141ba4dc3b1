"""Attention of one new token per row over the slot store.

Through MLX's own ``scaled_dot_product_attention``, with the step's boolean mask (the
keys each row may attend to). A row decoded alone goes through the same function on its
own cache, without a mask, so a batched row takes the same arithmetic as that row alone:
MLX's fused kernel where it has one for the shape, otherwise MLX's own composition (the
grouped query heads broadcast against their key/value head, masked softmax in full
precision). A hand-grouped layout (a key/value head's query heads as the rows of one
matmul) rounds differently on CUDA: on an H100 with the float32 fixtures it agreed with
one-at-a-time decoding on 5 of 8 ragged rows over 40 greedy steps, against 8 of 8 this
way (``bench/decode_step.py --check``).
"""

from __future__ import annotations

import mlx.core as mx


def attend(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array):
    """``q`` (slots, heads, 1, dim); ``keys``/``values`` (slots, kv_heads, span, dim);
    ``mask`` (slots, 1, 1, span) bool. Returns (slots, heads * dim)."""
    slots, heads, _, dim = q.shape
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out.reshape(slots, heads * dim)
