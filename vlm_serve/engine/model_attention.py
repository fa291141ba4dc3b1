"""On CUDA, the attention of mlx-vlm's language models on the engine's own kernel.

Every family but Gemma 3 prefills through mlx-vlm's model code, whose attention layers
call the module-level ``scaled_dot_product_attention`` of mlx-vlm (or mlx-lm). On CUDA
that composes a pass's queries into matmuls whose kernels follow the pass's shape, and
a pass's shape follows what shares it: a shared pass stacks prompts and pads them, a
prefix-cache hit moves a prompt's chunk boundaries. Where the engine keeps rows exact
(``row_exact``), ``route`` points those modules' name at ``exact_attention``, which
runs ``cuda_attention.prefill_attention``: each query's sums follow the keys it sees
and nothing else, so a prompt gets the same bits in any pass.

The mask is read as mlx-vlm gives it: none (every key), ``"causal"``, or a boolean
array (a sliding window, Gemma 4's images seeing each other both ways). A call the
kernel cannot take (attention sinks, a quantized cache, an additive mask, keys and
values of other sizes) goes to MLX's attention and is logged once: its rows may then
differ batched from alone.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.base
import mlx_vlm.models.base

from .decode import cuda_attention

log = logging.getLogger("vlm_serve.engine")

NAME = "scaled_dot_product_attention"  # what mlx-vlm's (and mlx-lm's) layers call
# The functions routed, wherever a module has imported them (a function of a model's own
# under that name is left alone: its arguments may mean something else).
ROUTABLE = {mlx_vlm.models.base.scaled_dot_product_attention,
            mlx_lm.models.base.scaled_dot_product_attention}
MAX_QUERIES = 65_535  # the kernel's rows per pass (CUDA's grid z)


def route(language_model: nn.Module) -> list[str]:
    """Point the attention of every module defining ``language_model``'s layers at
    ``exact_attention``, in place (process-wide: those modules' other models too).
    Returns the modules routed: none where ``VLM_SERVE_DECODE_ATTENTION=mlx`` keeps
    MLX's attention."""
    from .decode.attention import uses_kernels  # (it reads row_exact, which imports this)

    if not uses_kernels():
        return []
    routed = []
    for name in sorted({type(m).__module__ for _, m in language_model.named_modules()}):
        module = sys.modules.get(name)
        original = getattr(module, NAME, None)
        if original not in ROUTABLE:
            continue  # none, already routed, or the model's own
        setattr(module, NAME, exact_attention(original))
        routed.append(name)
    return routed


def unroute(names: list[str]) -> None:
    """Give the modules ``route`` routed their own attention back."""
    for name in names:
        module = sys.modules[name]
        setattr(module, NAME, getattr(module, NAME).routed_from)


@functools.cache
def exact_attention(original):
    """``original`` (an attention function with mlx-vlm's signature) on the kernel."""

    def attention(queries, keys, values, cache=None, scale: float = 1.0, mask=None, sinks=None):
        plan = kernel_plan(queries, keys, values, cache, mask, sinks)
        if isinstance(plan, str):
            _warn_once(plan)
            return original(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        causal, rows_mask = plan
        B, heads, L, dim = queries.shape
        out = cuda_attention.prefill_attention(queries, keys, values, scale, causal=causal,
                                               mask=rows_mask, origin=_origin(cache, keys))
        return out.reshape(B, L, heads, dim).transpose(0, 2, 1, 3)

    attention.routed_from = original
    return attention


class _PassOffset(threading.local):
    """The offset of the last layer cache this thread's attention saw: the pass's, for
    layers that read another layer's keys and get no cache (Gemma 4's KV-shared layers,
    which come after the layers they read)."""

    offset: int | None = None


_pass = _PassOffset()


def _origin(cache, keys: mx.array) -> int:
    """The position of ``keys``' column 0 (``cuda_attention.key_origin``). A layer given
    no cache reads the keys of an earlier layer of this pass, whose caches all share one
    offset."""
    if cache is not None:
        _pass.offset = getattr(cache, "offset", None)
    return cuda_attention.key_origin(_pass.offset, keys)


def kernel_plan(queries, keys, values, cache, mask, sinks) -> tuple[bool, mx.array | None] | str:
    """How the kernel takes a call: (causal, mask rows (1 or B, L, columns) or None);
    or, where it cannot, why."""
    if sinks is not None:
        return "attention sinks"
    if cache is not None and (hasattr(cache, "bits") or hasattr(cache, "dequantize")):
        return "a quantized key/value cache"
    if queries.ndim != 4 or keys.shape[-1] != values.shape[-1] or keys.shape[-1] != queries.shape[-1]:
        return "keys and values of other sizes than the queries"
    if not keys.dtype == values.dtype == queries.dtype:
        return "keys and values of another dtype than the queries"
    B, _, L, _ = queries.shape
    if B * L > MAX_QUERIES:
        return f"more than {MAX_QUERIES} queries in one pass"
    if mask is None:
        return False, None  # every key (one query: its whole cache)
    if isinstance(mask, str):
        return (True, None) if mask == "causal" else f"a mask {mask!r}"
    if mask.dtype != mx.bool_:
        return "an additive mask"
    columns = keys.shape[2]
    # The axes before (L, columns) meet the scores' (prompts, heads) from the right: the
    # kernel takes one set of rows, or one per prompt, for every head.
    lead = mask.shape[:-2]
    rows = lead[0] if len(lead) == 2 else 1
    if len(lead) > 2 or math.prod(lead) != rows or rows not in (1, B):
        return "a mask per head"
    if mask.shape[-2] not in (1, L) or mask.shape[-1] not in (1, columns):
        return "a mask of another shape than the scores"
    return False, mx.broadcast_to(mask.reshape(rows, *mask.shape[-2:]), (rows, L, columns))


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("CUDA: attention with %s runs on MLX's kernels; rows sharing its passes may "
                "differ from the same rows alone", reason)
