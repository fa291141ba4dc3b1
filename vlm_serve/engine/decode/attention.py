"""Attention of one new token per row over the slot store.

On CUDA, through this engine's own kernels (``cuda_attention``): each row reads its own
keys only, and takes the same arithmetic batched as alone. Elsewhere, through MLX's own
``scaled_dot_product_attention`` with the step's boolean mask (the keys each row may
attend to): a row decoded alone goes through the same function on its own cache,
without a mask, so a batched row takes the same arithmetic as that row alone (on the
CPU, to the bit: the parity suite). A hand-grouped layout (a key/value head's query
heads as the rows of one matmul) rounds differently on CUDA: on an H100 with the
float32 fixtures it agreed with one-at-a-time decoding on 5 of 8 ragged rows over 40
greedy steps, against 8 of 8 this way (``bench/decode_step.py --check``).

Prefill passes on CUDA take a kernel of the same design (``prefill_attend``): short
ones always, longer ones where the engine keeps rows exact (``row_exact``), since MLX's
composed attention multiplies a pass's queries in one matmul, whose kernel follows the
pass's length (a prompt alone and the same prompt padded into a shared pass would get
other bits). The prefill passes of mlx-vlm's own model code take it there too
(``model_attention``).

``VLM_SERVE_DECODE_ATTENTION=mlx`` keeps MLX's attention on CUDA too, for both (for
comparison).
"""

from __future__ import annotations

import os

import mlx.core as mx

from .. import row_exact
from . import cuda_attention

_USE_KERNELS = os.environ.get("VLM_SERVE_DECODE_ATTENTION", "kernels") != "mlx"


# Prefill passes of up to this many queries per prompt take the CUDA kernel: each query
# reads its keys on its own, which longer passes do more cheaply through MLX's matmuls
# (where rows need not be exact: ``VLM_SERVE_MATMUL=mlx``).
# On an H100 (Gemma-3-4B shape, 300-1000 cached keys, 16-64 queries) the kernel's pass
# launched in 6.6-9.9 ms against 12-14 ms, and finished at most 1.5 ms later.
PREFILL_KERNEL_MAX_QUERIES = 64


def uses_kernels() -> bool:
    """Whether decode attention runs on this engine's CUDA kernels, which take each
    row's count of visible keys, rather than MLX's attention, which takes a mask."""
    return _USE_KERNELS and cuda_attention.available()


def attend(q: mx.array, keys: mx.array, values: mx.array, scale: float,
           visible: mx.array) -> mx.array:
    """``q`` (slots, heads, 1, dim); ``keys``/``values`` a layer's whole store (slots,
    kv_heads, columns, dim); ``visible`` the leading columns each row attends to, as the
    step's store layout gives them for the layer's kind: counts (slots,) int32 for the
    kernels (so a step's shapes do not change as rows grow: no new compiled trace), or
    a mask (slots, 1, 1, span) bool for MLX. Returns (slots, heads * dim)."""
    if visible.ndim == 1:
        return cuda_attention.decode_attention(q, keys, values, visible, scale)
    return mlx_attend(q, keys, values, scale, visible)


def mlx_attend(q: mx.array, keys: mx.array, values: mx.array, scale: float,
               mask: mx.array) -> mx.array:
    """``attend`` through MLX's own attention, on every backend, with a mask."""
    slots, heads, _, dim = q.shape
    keys, values = masked_span(keys, values, mask)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out.reshape(slots, heads * dim)


def masked_span(keys: mx.array, values: mx.array, mask: mx.array) -> tuple[mx.array, mx.array]:
    """A layer's keys/values cut to the columns ``mask`` spans (the step's span)."""
    span = mask.shape[-1]
    if span < keys.shape[2]:
        return keys[:, :, :span], values[:, :, :span]
    return keys, values


def prefill_attend(queries: int, scale: float, window: int | None):
    """Where a prefill pass of ``queries`` queries per prompt runs on this engine's CUDA
    kernel, its attention for layers of ``window``: ``(q (B, heads, L, dim), keys,
    values, origin) -> (B * L, heads * dim)``, causal and within the window as mlx-lm's
    masks are (``origin``: the position of the keys' column 0, ``cuda_attention.
    key_origin``). None where it does not (then the family's own attention runs)."""
    if not uses_kernels() or (queries > PREFILL_KERNEL_MAX_QUERIES and not row_exact.applies()):
        return None
    return lambda q, keys, values, origin: cuda_attention.prefill_attention(q, keys, values, scale, window,
                                                                            origin=origin)
