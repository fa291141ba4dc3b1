"""Gemma 3's decode step on the slot store, with mlx-vlm's weights and numerics.

The same computation as mlx-vlm's Gemma 3 language model for one new token per row,
without what a general forward pass pays for on every layer: masks and offsets are
built once per step (by the store), RMSNorm weights are ``1 + w`` once at load, the
query/key/value projections are one matmul (their weights fused at load, the model's
own projections left as views of the fused weight so prefill is unchanged), and the
single-token head transposes are reshapes.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn import gelu_approx
from mlx_vlm.models.gemma3.language import clip_residual

from .attention import additive_mask, attend
from .fused import StepLinear, fuse_linears
from .store import LayerKind, SlotStore


class Gemma3Decoder:
    def __init__(self, model):
        self.lm = model.language_model
        text = self.lm.model
        config = text.config
        pattern = text.sliding_window_pattern
        self.layer_kinds = [
            LayerKind(None if i % pattern == pattern - 1 else text.window_size)
            for i in range(len(text.layers))
        ]
        self.kv_heads = config.num_key_value_heads
        self.groups = config.num_attention_heads // self.kv_heads  # query heads per kv head
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.embed_scale = mx.array(config.hidden_size**0.5, mx.bfloat16)
        self.layers = [_Layer(layer, self.eps) for layer in text.layers]
        self.final_norm = 1.0 + text.norm.weight

    def new_store(self) -> SlotStore:
        return SlotStore(self.layer_kinds, self.kv_heads, self.head_dim)

    def __call__(self, tokens: mx.array, store: SlotStore) -> mx.array:
        """Logits (slots, vocab) of one decode step; ``tokens`` is (slots,)."""
        positions, layouts = store.layout()
        text = self.lm.model
        # Activations stay (slots, hidden): a 3-D input would cost every matmul a
        # flatten and an unflatten.
        h = text.embed_tokens(tokens)
        h = h * self.embed_scale.astype(h.dtype)
        masks = {
            kind: additive_mask(layout.mask, self.kv_heads, self.groups, h.dtype)
            for kind, layout in layouts.items()
        }
        for i, (layer, kind) in enumerate(zip(self.layers, self.layer_kinds)):
            key = kind.window or 0
            h = layer(h, positions, layouts[key], masks[key], store, i)
        store.advance()
        h = mx.fast.rms_norm(h, self.final_norm, self.eps)
        return self.lm.lm_head(h)


class _Layer:
    def __init__(self, block, eps: float):
        attn = block.self_attn
        self.attn = attn
        self.mlp = block.mlp
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
        self.gate_up, self.gate_up_split = fuse_linears([self.mlp.gate_proj, self.mlp.up_proj])
        self.o_proj = StepLinear(attn.o_proj)
        self.down_proj = StepLinear(self.mlp.down_proj)
        mx.eval(self.norms, self.q_norm, self.k_norm)

    def _norm(self, name: str, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.norms[name], self.eps)

    def __call__(self, x, positions, layout, mask, store: SlotStore, index: int) -> mx.array:
        attn = self.attn
        B = x.shape[0]
        x = clip_residual(x)
        q, k, v = mx.split(self.qkv(self._norm("input_layernorm", x)), self.qkv_split, axis=-1)
        # One token per row: (B, heads * dim) is (B, heads, 1, dim) without a transpose.
        q = mx.fast.rms_norm(q.reshape(B, attn.n_heads, 1, -1), self.q_norm, self.eps)
        k = mx.fast.rms_norm(k.reshape(B, attn.n_kv_heads, 1, -1), self.k_norm, self.eps)
        v = v.reshape(B, attn.n_kv_heads, 1, -1)
        q = attn.rope(q, offset=positions)
        k = attn.rope(k, offset=positions)
        keys, values = store.update(index, layout, k, v)
        r = self.o_proj(attend(q, keys, values, attn.scale, mask))
        h = clip_residual(x + self._norm("post_attention_layernorm", r))
        gate, up = mx.split(
            self.gate_up(self._norm("pre_feedforward_layernorm", h)), self.gate_up_split, axis=-1
        )
        r = self.down_proj(_gelu_times(gate, up))
        return clip_residual(h + self._norm("post_feedforward_layernorm", r))



@mx.compile
def _gelu_times(gate: mx.array, up: mx.array) -> mx.array:
    """Gemma's MLP activation, one fused kernel instead of several elementwise ones
    (the same operations in the same order as ``gelu_approx(gate) * up``)."""
    return gelu_approx(gate) * up
