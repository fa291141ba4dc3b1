"""Attention of one new token per row over the slot store.

MLX's fused attention kernel does not take this step's mask on every backend (on CUDA
it falls back to a general composition of a dozen ops per layer, broadcasting keys to
every query head). With one query per head, the grouped query heads of a key/value
head can instead be the rows of one matmul: no broadcast, no head reshuffling, and the
mask is added (built once per step at the scores' shape, so no per-layer broadcast).
The arithmetic is MLX's own fallback's: scaled queries, one matmul, masked softmax in
full precision, one matmul.
"""

from __future__ import annotations

import mlx.core as mx


def additive_mask(valid: mx.array, kv_heads: int, groups: int, dtype) -> mx.array:
    """(slots, 1, 1, span) bool -> (slots, kv_heads, groups, span) 0 / -inf."""
    slots, span = valid.shape[0], valid.shape[-1]
    mask = mx.where(valid, mx.array(0, dtype), mx.array(-mx.inf, dtype))
    return mx.broadcast_to(mask, (slots, kv_heads, groups, span))


def attend(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array):
    """``q`` (slots, heads, 1, dim); ``keys``/``values`` (slots, kv_heads, span, dim);
    ``mask`` from ``additive_mask``. Returns (slots, heads * dim)."""
    slots, heads, _, dim = q.shape
    kv_heads = keys.shape[1]
    q = (q * scale).reshape(slots, kv_heads, heads // kv_heads, dim)
    scores = mx.matmul(q, keys.swapaxes(-1, -2)) + mask
    weights = mx.softmax(scores, axis=-1, precise=True)
    return mx.matmul(weights, values).reshape(slots, heads * dim)
