"""Gemma 3's decode step on the slot store, with mlx-vlm's weights and numerics.

The same computation as mlx-vlm's Gemma 3 language model for one new token per row,
without what a general forward pass pays for on every layer: masks and offsets are
built once per step (by the store), RMSNorm weights are ``1 + w`` once at load, the
query/key/value projections are one matmul and gate/up another (their weights fused at
load, the model's own projections left as views of the fused weights), activations stay
2-D and single-token head transposes are reshapes. On CUDA each residual add and the
norms on either side of it run as one kernel (``cuda_norms``; the step's last norm of a
layer is the next layer's input norm), and so do the query and key heads' norms and
rotation (``cuda_heads``).

Prefill passes (``prefill``, ``head_of``) run on the same fused weights with mlx-vlm's
own masks, caches and attention, and the output layer on the last position only: on
the CPU their logits equal the model code's bit for bit (``tests/test_gemma3_prefill.py``).
On CUDA a pass runs its layers as the decode step does (the same two kernels, a layer
handing the next its input's norm) and attends with the engine's own kernel
(``attention.prefill_attend``): Gemma 3's head size takes MLX's composed fallback
there, ~20 graph nodes a layer, 40% of a short pass's launch on the host.
"""

from __future__ import annotations

import os

import mlx.core as mx
from mlx.nn import gelu_approx
from mlx_vlm.models.base import (
    create_attention_mask,
    kv_sequence_length,
    scaled_dot_product_attention,
)
from mlx_vlm.models.gemma3.language import clip_residual

from . import cuda_norms
from .attention import attend, prefill_attend
from .cuda_attention import key_origin
from .cuda_heads import AttentionHeads
from .cuda_norms import add_norm
from .fused import StepLinear, fuse_linears
from .step import KVWriter, StepDecoder
from .store import LayerKind

# Set VLM_SERVE_FUSED_PREFILL=0 to run CUDA passes on the model code's ops (for comparison).
FUSED_PREFILL = os.environ.get("VLM_SERVE_FUSED_PREFILL", "1") != "0"


class Gemma3Decoder(StepDecoder):
    def __init__(self, model):
        self.lm = model.language_model
        text = self.lm.model
        config = text.config
        pattern = text.sliding_window_pattern
        kinds = [
            LayerKind(None if i % pattern == pattern - 1 else text.window_size)
            for i in range(len(text.layers))
        ]
        self.eps = config.rms_norm_eps
        self.embed = text.embed_tokens
        self.embed_scale = mx.array(config.hidden_size**0.5, mx.bfloat16)
        self.layers = [_Layer(layer, self.eps) for layer in text.layers]
        self.final_norm = 1.0 + text.norm.weight
        self.head = StepLinear(self.lm.lm_head)
        mx.eval(self.final_norm)
        attn = text.layers[0].self_attn  # head counts from the layer (a sharded one has fewer)
        super().__init__(kinds, attn.n_heads, attn.n_kv_heads, config.head_dim)

    def prefill(self, inputs_embeds: mx.array, cache: list, last: mx.array | None = None) -> mx.array:
        """One prefill pass over the model's own caches, as mlx-vlm's language model
        runs it (the same masks, caches and attention), on the fused weights: each
        row's hidden state at its position in ``last`` (default: the pass's last),
        before the final norm."""
        h = inputs_embeds * self.embed_scale.astype(inputs_embeds.dtype)
        B, L, hidden = h.shape
        attends = {}  # one per layer kind: its mask is built once for the pass
        for kind, layer_cache in zip(self.layer_kinds, cache):
            if kind.window not in attends:
                attends[kind.window] = self._pass_attention(h, layer_cache, kind.window)
        h = h.reshape(B * L, hidden)
        offset = cache[0].offset
        if FUSED_PREFILL and isinstance(offset, int) and self.layers[0].heads.fits(h.dtype) and cuda_norms.fits(h):
            # On CUDA, as the decode step runs a layer: its heads and its residual norms
            # as the engine's kernels, each layer handing the next its input's norm.
            starts = mx.full((B,), offset, mx.int32)  # every row's first position in the pass
            n = self.layers[0].norm("input_layernorm", h)
            layers = zip(self.layers, self.layer_kinds, cache, self._next_norms())
            for layer, kind, layer_cache, next_norm in layers:
                h, n = layer.prefill_fused(h, n, next_norm, L, layer_cache, attends[kind.window], starts)
        else:
            for layer, kind, layer_cache in zip(self.layers, self.layer_kinds, cache):
                h = layer.prefill(h, B, L, layer_cache, attends[kind.window])
        h = h.reshape(B, L, hidden)
        if last is None:
            return h[:, -1, :]
        return mx.take_along_axis(h, last[:, None, None], axis=1)[:, 0, :]

    def _pass_attention(self, h: mx.array, cache, window: int | None):
        """The attention of one pass's layers of one kind (``window``, from a cache of
        theirs): ``(q, keys, values, cache) -> (B * L, heads * dim)``."""
        B, L, _ = h.shape
        scale = self.lm.model.layers[0].self_attn.scale
        kernel = prefill_attend(L, scale, window)
        if kernel is not None:
            return lambda q, keys, values, layer_cache: kernel(q, keys, values,
                                                               key_origin(layer_cache.offset, keys))
        mask = create_attention_mask(h, cache, window_size=window)

        def attend_mlx(q, keys, values, layer_cache):
            m = mask
            if isinstance(m, mx.array) and m.shape[-1] != kv_sequence_length(keys):
                m = m[..., -kv_sequence_length(keys):]
            out = scaled_dot_product_attention(q, keys, values, layer_cache, scale=scale, mask=m)
            return out.transpose(0, 2, 1, 3).reshape(B * L, -1)

        return attend_mlx

    def head_of(self, hidden: mx.array) -> mx.array:
        """Logits of last-position hidden states from ``prefill``."""
        return self.head(mx.fast.rms_norm(hidden, self.final_norm, self.eps))

    def forward(self, tokens, positions, indices, visible, keys, values):
        h = self.embed(tokens)  # (slots, hidden): 3-D would cost each matmul a reshape
        h = clip_residual(h * self.embed_scale.astype(h.dtype))
        write = KVWriter(self, indices, keys, values)
        # Each layer takes its input and the input's norm, and returns its output and
        # the norm the next layer (or the output layer) takes of it.
        n = self.layers[0].norm("input_layernorm", h)
        for i, (layer, next_norm) in enumerate(zip(self.layers, self._next_norms())):
            h, n = layer(h, n, next_norm, positions, visible[self.kind_index[i]], write, i)
        return self.head(n), write.keys, write.values

    def _next_norms(self) -> list[mx.array]:
        """The norm each layer's output takes next: the next layer's input norm, or
        the final norm."""
        return [layer.norms["input_layernorm"] for layer in self.layers[1:]] + [self.final_norm]


class _Layer:
    def __init__(self, block, eps: float):
        attn = block.self_attn
        self.attn = attn
        self.eps = eps
        self.norms = {
            name: 1.0 + getattr(block, name).weight
            for name in (
                "input_layernorm", "post_attention_layernorm",
                "pre_feedforward_layernorm", "post_feedforward_layernorm",
            )
        }
        self.q_norm = 1.0 + attn.q_norm.weight
        self.k_norm = 1.0 + attn.k_norm.weight
        self.qkv, self.qkv_split = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.heads = AttentionHeads(attn.n_heads, attn.n_kv_heads, attn.head_dim, self.q_norm, self.k_norm,
                                    eps, attn.rope)
        self.gate_up, self.gate_up_split = fuse_linears([block.mlp.gate_proj, block.mlp.up_proj])
        self.o_proj = StepLinear(attn.o_proj)
        self.down_proj = StepLinear(block.mlp.down_proj)
        mx.eval(self.norms, self.q_norm, self.k_norm)

    def norm(self, name: str, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.norms[name], self.eps)

    def __call__(self, x, normed, next_norm, positions, visible, write: KVWriter,
                 index: int) -> tuple[mx.array, mx.array]:
        """One decode step of the layer: ``x`` its input and ``normed`` the input's
        norm; returns its output and that output's norm by ``next_norm``."""
        attn = self.attn
        # The heads' norms and rotation: one kernel on CUDA.
        q, k, v = self.heads(self.qkv(normed), positions)
        keys, values = write(index, k, v)
        return self._residuals_and_mlp(x, self.o_proj(attend(q, keys, values, attn.scale, visible)), next_norm)

    def prefill_fused(self, x: mx.array, normed: mx.array, next_norm: mx.array, L: int, cache, attention,
                      starts: mx.array) -> tuple[mx.array, mx.array]:
        """One layer of a prefill pass as the decode step runs it (CUDA): ``x`` (B * L,
        hidden) its input and ``normed`` the input's norm, ``starts`` each row's first
        position; returns its output and that output's norm by ``next_norm``."""
        q, k, v = self.heads.fused(self.qkv(normed), starts, L)
        keys, values = cache.update_and_fetch(k, v)
        return self._residuals_and_mlp(x, self.o_proj(attention(q, keys, values, cache)), next_norm)

    def _residuals_and_mlp(self, x: mx.array, r: mx.array, next_norm: mx.array) -> tuple[mx.array, mx.array]:
        """The layer's output from its input ``x`` and attention output ``r``, and that
        output's norm by ``next_norm``: each residual add and the norms on either side
        of it one kernel on CUDA."""
        h, normed = add_norm(x, r, self.norms["post_attention_layernorm"],
                             self.norms["pre_feedforward_layernorm"], self.eps, clip_residual)
        gate, up = mx.split(self.gate_up(normed), self.gate_up_split, axis=-1)
        r = self.down_proj(_gelu_times(gate, up))
        return add_norm(h, r, self.norms["post_feedforward_layernorm"], next_norm, self.eps, clip_residual)

    def prefill(self, x: mx.array, B: int, L: int, cache, attention) -> mx.array:
        """``x`` (B * L, hidden): one layer of a prefill pass (mlx-vlm's
        ``TransformerBlock`` on the fused weights); ``attention`` its pass's, for the
        layer's kind (``Gemma3Decoder._pass_attention``)."""
        attn = self.attn
        x = clip_residual(x)
        q, k, v = self._qkv(x)
        q = mx.fast.rms_norm(q.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3), self.q_norm, self.eps)
        k = mx.fast.rms_norm(k.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3), self.k_norm, self.eps)
        v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q = attn.rope(q, offset=cache.offset)
        k = attn.rope(k, offset=cache.offset)
        keys, values = cache.update_and_fetch(k, v)
        return self._after_attention(x, self.o_proj(attention(q, keys, values, cache)))

    def _qkv(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values of ``x`` (2-D), from the one fused projection."""
        return mx.split(self.qkv(self.norm("input_layernorm", x)), self.qkv_split, axis=-1)

    def _after_attention(self, x: mx.array, r: mx.array) -> mx.array:
        """The layer's output from its input ``x`` and attention output ``r``: the
        residuals and the MLP."""
        h = clip_residual(x + self.norm("post_attention_layernorm", r))
        gate, up = mx.split(
            self.gate_up(self.norm("pre_feedforward_layernorm", h)), self.gate_up_split, axis=-1
        )
        r = self.down_proj(_gelu_times(gate, up))
        return clip_residual(h + self.norm("post_feedforward_layernorm", r))


@mx.compile
def _gelu_times(gate: mx.array, up: mx.array) -> mx.array:
    """Gemma's MLP activation, one fused kernel instead of several elementwise ones
    (the same operations in the same order as ``gelu_approx(gate) * up``)."""
    return gelu_approx(gate) * up
