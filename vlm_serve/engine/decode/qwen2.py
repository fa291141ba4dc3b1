"""The decode step of Qwen2-VL and Qwen2.5-VL's language model on the slot store.

At decode time a row's three mRoPE axes all hold the same position (its token count
plus the row's ``rope_delta``, which an image in its prompt sets), and 3-axis rotary
embedding with equal positions is the ordinary rotary embedding at that position: one
``mx.fast.rope`` per tensor with a per-row offset, instead of cos/sin tables applied by
hand. Otherwise the same computation as mlx-vlm's model code: fused q/k/v (with their
biases) and gate/up matmuls, attention as in ``attention.py``, SwiGLU.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.activations import swiglu

from .attention import additive_mask, attend
from .fused import StepLinear, fuse_linears
from .store import LayerKind, SlotStore


class Qwen2Decoder:
    def __init__(self, model):
        self.lm = model.language_model
        text = self.lm.model
        args = self.lm.args
        self.kv_heads = args.num_key_value_heads
        self.heads = args.num_attention_heads
        self.head_dim = args.hidden_size // self.heads
        self.groups = self.heads // self.kv_heads
        self.rope_base = float(args.rope_theta)
        self.layer_kinds = [LayerKind(None) for _ in text.layers]
        self.layers = [_Layer(layer, self) for layer in text.layers]
        if args.tie_word_embeddings:
            self.head = StepLinear(text.embed_tokens, tied=True)
        else:
            self.head = StepLinear(self.lm.lm_head)

    def new_store(self) -> SlotStore:
        return SlotStore(self.layer_kinds, self.kv_heads, self.head_dim)

    def __call__(self, tokens: mx.array, store: SlotStore) -> mx.array:
        """Logits (slots, vocab) of one decode step; ``tokens`` is (slots,)."""
        positions, layouts = store.layout()
        rope_positions = store.rope_positions(positions)
        text = self.lm.model
        h = text.embed_tokens(tokens)  # (slots, hidden): 2-D keeps matmuls flat
        layout = layouts[0]
        mask = additive_mask(layout.mask, self.kv_heads, self.groups, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, rope_positions, layout, mask, store, i)
        store.advance()
        return self.head(text.norm(h))

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=self.rope_base, scale=1.0,
            offset=positions,
        )


class _Layer:
    def __init__(self, block, decoder: Qwen2Decoder):
        attn = block.self_attn
        self.decoder = decoder
        self.input_norm = block.input_layernorm
        self.post_norm = block.post_attention_layernorm
        self.scale = attn.scale
        self.qkv, self.qkv_split = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up, self.gate_up_split = fuse_linears([block.mlp.gate_proj, block.mlp.up_proj])
        self.o_proj = StepLinear(attn.o_proj)
        self.down_proj = StepLinear(block.mlp.down_proj)

    def __call__(self, x, positions, layout, mask, store: SlotStore, index: int) -> mx.array:
        d = self.decoder
        B = x.shape[0]
        q, k, v = mx.split(self.qkv(self.input_norm(x)), self.qkv_split, axis=-1)
        # One token per row: (B, heads * dim) is (B, heads, 1, dim) without a transpose.
        q = d.rope(q.reshape(B, d.heads, 1, d.head_dim), positions)
        k = d.rope(k.reshape(B, d.kv_heads, 1, d.head_dim), positions)
        keys, values = store.update(index, layout, k, v.reshape(B, d.kv_heads, 1, d.head_dim))
        h = x + self.o_proj(attend(q, keys, values, self.scale, mask))
        gate, up = mx.split(self.gate_up(self.post_norm(h)), self.gate_up_split, axis=-1)
        return h + self.down_proj(swiglu(gate, up))
