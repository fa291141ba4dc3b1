"""The decode step of GLM-4V's (GLM-4.1V's) language model on the slot store.

The same computation as mlx-vlm's ``glm4v/language.py`` for one token per row: RMSNorm
before attention and MLP and after each of them too (GLM-4's post-self-attention and
post-MLP norms), q/k/v with biases (one fused matmul), the model's gate_up MLP, and rotary
embedding on the first ``partial_rotary_factor`` of each head with even/odd pairs.

The model's rotary embedding is its own module, not ``mx.fast.rope``: cos/sin from
``inv_freq @ position_ids`` on three axes, cut into ``mrope_section`` pieces per axis and
applied by hand. At decode a row's three axes hold the same position (its token count
plus its ``rope_delta``), so the sections pick equal values; the step computes cos/sin
once, with the model's ops in its order and dtypes, in the layout its apply ends with
(each frequency's value twice, for its even/odd pair), and every layer shares them.

(On Metal mlx-vlm may apply rotary through a fused kernel of its own, whose rounding this
step does not claim to reproduce; exactness against the model code is proven on the CPU.)
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn import silu
from mlx_vlm.models.rope_utils import _apply_rotary_embedding, rotate_half_even_odd

from .attention import attend
from .fused import StepLinear, fuse_linears
from .step import KVWriter, StepDecoder
from .store import LayerKind


class Glm4vDecoder(StepDecoder):
    def __init__(self, model):
        self.lm = model.language_model
        text = self.lm.model
        if type(text).__name__ != "GLM4VModel":
            raise TypeError(f"{type(text).__name__} is not GLM-4V's text model")
        attn = text.layers[0].self_attn  # head counts from the layer (a sharded one has fewer)
        head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
        self.rotary = text.rotary_emb
        self.embed = text.embed_tokens
        self.final_norm = text.norm
        self.layers = [_Layer(layer) for layer in text.layers]
        self.head = StepLinear(self.lm.lm_head)
        kinds = [LayerKind(None) for _ in text.layers]
        super().__init__(kinds, attn.n_heads, attn.n_kv_heads, head_dim)

    def forward(self, tokens, positions, indices, visible, keys, values):
        h = self.embed(tokens)  # (slots, hidden): 3-D would cost each matmul a reshape
        rope = self.shared_rope(positions, h.dtype)
        write = KVWriter(self, indices, keys, values)
        for i, layer in enumerate(self.layers):
            h = layer(self, h, rope, visible[self.kind_index[i]], write, i)
        return self.head(self.final_norm(h)), write.keys, write.values

    def shared_rope(self, positions: mx.array, dtype):
        """Rotary embedding of every layer this step, cos/sin computed once.

        The model: ``freqs = inv_freq @ position`` (float32, one product each), cos/sin
        of ``concat(freqs, freqs)`` times ``attention_scaling``, cast to the hidden
        dtype; then per layer the sections' values (equal across axes here), the first
        half each repeated twice, and ``_apply_rotary_embedding`` with even/odd pairs."""
        inv_freq = self.rotary._inv_freq.astype(mx.float32)
        freqs = (inv_freq[:, None] @ positions.astype(mx.float32)[:, None, None])[..., 0]
        cos, sin = mx.cos(freqs), mx.sin(freqs)  # (slots, rotary_dim / 2)
        scaling = self.rotary.attention_scaling
        if scaling != 1.0:  # the model multiplies by it; by 1.0 changes no bit
            cos, sin = cos * scaling, sin * scaling
        B = positions.shape[0]
        # (slots, 1, 1, rotary_dim): broadcast over heads and the one token.
        cos = mx.repeat(cos.astype(dtype), 2, axis=-1).reshape(B, 1, 1, -1)
        sin = mx.repeat(sin.astype(dtype), 2, axis=-1).reshape(B, 1, 1, -1)

        def rope(q, k):
            return _apply_rotary_embedding(q, k, cos, sin, rotate_half_even_odd)

        return rope


class _Layer:
    def __init__(self, block):
        attn, mlp = block.self_attn, block.mlp
        self.input_norm = block.input_layernorm
        self.post_attn_out_norm = block.post_self_attn_layernorm
        self.pre_mlp_norm = block.post_attention_layernorm
        self.post_mlp_norm = block.post_mlp_layernorm
        self.scale = attn.scale
        self.qkv, self.qkv_split = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.o_proj = StepLinear(attn.o_proj)
        self.gate_up = StepLinear(mlp.gate_up_proj)  # already one layer in the model
        self.down_proj = StepLinear(mlp.down_proj)

    def __call__(self, d: Glm4vDecoder, x, rope, visible, write: KVWriter, index: int):
        B = x.shape[0]
        q, k, v = mx.split(self.qkv(self.input_norm(x)), self.qkv_split, axis=-1)
        # One token per row: (B, heads * dim) is (B, heads, 1, dim) without a transpose.
        q = q.reshape(B, d.heads, 1, d.head_dim)
        k = k.reshape(B, d.kv_heads, 1, d.head_dim)
        q, k = rope(q, k)
        keys, values = write(index, k, v.reshape(B, d.kv_heads, 1, d.head_dim))
        h = x + self.post_attn_out_norm(self.o_proj(attend(q, keys, values, self.scale, visible)))
        gate, up = mx.split(self.gate_up(self.pre_mlp_norm(h)), 2, axis=-1)
        return h + self.post_mlp_norm(self.down_proj(silu(gate) * up))
