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

from .attention import attend
from .fused import StepLinear, fuse_linears
from .step import KVWriter, StepDecoder
from .store import LayerKind


class Qwen2Decoder(StepDecoder):
    def __init__(self, model):
        self.lm = model.language_model
        text = self.lm.model
        args = self.lm.args
        heads = args.num_attention_heads
        self.rope_base = float(args.rope_theta)
        self.embed = text.embed_tokens
        self.final_norm = text.norm
        self.layers = [_Layer(layer) for layer in text.layers]
        if args.tie_word_embeddings:
            self.head = StepLinear(text.embed_tokens, tied=True)
        else:
            self.head = StepLinear(self.lm.lm_head)
        attn = text.layers[0].self_attn  # head counts from the layer (a sharded one has fewer)
        super().__init__(
            [LayerKind(None) for _ in text.layers], attn.n_heads, attn.n_kv_heads,
            args.hidden_size // heads,
        )

    def forward(self, tokens, positions, indices, masks, keys, values):
        h = self.embed(tokens)  # (slots, hidden): 3-D would cost each matmul a reshape
        mask = self.additive_masks(masks, h.dtype)[0]
        write = KVWriter(self, indices, masks, keys, values)
        for i, layer in enumerate(self.layers):
            h = layer(self, h, positions, mask, write, i)
        return self.head(self.final_norm(h)), write.keys, write.values

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=self.rope_base, scale=1.0,
            offset=positions,
        )


class _Layer:
    def __init__(self, block):
        attn = block.self_attn
        self.input_norm = block.input_layernorm
        self.post_norm = block.post_attention_layernorm
        self.scale = attn.scale
        self.qkv, self.qkv_split = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up, self.gate_up_split = fuse_linears([block.mlp.gate_proj, block.mlp.up_proj])
        self.o_proj = StepLinear(attn.o_proj)
        self.down_proj = StepLinear(block.mlp.down_proj)

    def __call__(self, d: Qwen2Decoder, x, positions, mask, write: KVWriter, index: int):
        B = x.shape[0]
        q, k, v = mx.split(self.qkv(self.input_norm(x)), self.qkv_split, axis=-1)
        # One token per row: (B, heads * dim) is (B, heads, 1, dim) without a transpose.
        q = d.rope(q.reshape(B, d.heads, 1, d.head_dim), positions)
        k = d.rope(k.reshape(B, d.kv_heads, 1, d.head_dim), positions)
        keys, values = write(index, k, v.reshape(B, d.kv_heads, 1, d.head_dim))
        h = x + self.o_proj(attend(q, keys, values, self.scale, mask))
        gate, up = mx.split(self.gate_up(self.post_norm(h)), self.gate_up_split, axis=-1)
        return h + self.down_proj(swiglu(gate, up))
