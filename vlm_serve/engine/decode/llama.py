"""The decode step of Llama-shaped language models on the slot store: RMSNorm, q/k/v/o
projections (biases and q/k RMSNorm where the model has them), rotary positions, a
SwiGLU MLP. Serves the text models of LLaVA, Idefics3/SmolVLM, InternVL and Mistral 3,
and (with their own positions, ``qwen2.py``) Qwen2-VL and Qwen2.5-VL, and (with sliding
windows and attention scaling, ``ministral3.py``) Ministral 3.

The same computation as mlx-vlm's model code for one token per row: fused q/k/v (with
their biases) and gate/up matmuls, attention as in ``attention.py``, each layer's own
rotary embedding called with per-row offsets.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_vlm.models.activations import swiglu

from .attention import attend
from .fused import StepLinear, fuse_linears
from .step import KVWriter, StepDecoder
from .store import LayerKind


class LlamaDecoder(StepDecoder):
    def __init__(self, model):
        self.lm = model.language_model
        # Most wrap the layers in `.model`; Idefics3's language model holds them itself.
        text = self.lm.model if "model" in self.lm else self.lm
        attn = text.layers[0].self_attn  # head counts from the layer (a sharded one has fewer)
        head_dim = getattr(attn, "head_dim", None) or attn.q_proj.weight.shape[0] // attn.n_heads
        self.embed = text.embed_tokens
        self.final_norm = text.norm
        self.layers = [_Layer(layer) for layer in text.layers]
        if "lm_head" in self.lm:
            self.head = StepLinear(self.lm.lm_head)
        else:
            self.head = StepLinear(text.embed_tokens, tied=True)
        super().__init__(self.layer_kinds_of(text), attn.n_heads, attn.n_kv_heads, head_dim)

    def layer_kinds_of(self, text) -> list[LayerKind]:
        """Each layer's attention: full attention unless a subclass knows windows."""
        return [LayerKind(None) for _ in text.layers]

    def forward(self, tokens, positions, indices, visible, keys, values, q_scale=None):
        """``q_scale`` (slots,): a per-row factor on the rotated queries (Ministral 3's
        attention scaling, ``ministral3.py``); None: none."""
        h = self.embed(tokens)  # (slots, hidden): 3-D would cost each matmul a reshape
        if q_scale is not None:  # cast once, as the model code casts before its layers
            q_scale = q_scale.astype(h.dtype)[:, None, None, None]
        write = KVWriter(self, indices, keys, values)
        for i, layer in enumerate(self.layers):
            seen = visible[self.kind_index[i]]
            h = layer(self, h, positions, seen, write, i, q_scale)
        return self.head(self.final_norm(h)), write.keys, write.values

    def rope(self, layer: "_Layer", x: mx.array, positions: mx.array) -> mx.array:
        return layer.rotary(x, offset=positions)


class _Layer:
    def __init__(self, block):
        attn = block.self_attn
        mlp = block.mlp
        if not all(name in mlp for name in ("gate_proj", "up_proj", "down_proj")):
            raise TypeError(f"{type(mlp).__name__} is not a SwiGLU MLP")
        self.input_norm = block.input_layernorm
        self.post_norm = block.post_attention_layernorm
        self.scale = attn.scale
        # (a module without children is an empty dict, so no `or` between modules)
        self.rotary = attn.rope if "rope" in attn else getattr(attn, "rotary_emb", None)
        self.q_norm = attn.get("q_norm") if getattr(attn, "_use_qk_norm", True) else None
        self.k_norm = attn.get("k_norm") if self.q_norm is not None else None
        self.qkv, self.qkv_split = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up, self.gate_up_split = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.o_proj = StepLinear(attn.o_proj)
        self.down_proj = StepLinear(mlp.down_proj)

    def __call__(self, d: LlamaDecoder, x, positions, visible, write: KVWriter, index: int,
                 q_scale=None):
        B = x.shape[0]
        q, k, v = mx.split(self.qkv(self.input_norm(x)), self.qkv_split, axis=-1)
        # One token per row: (B, heads * dim) is (B, heads, 1, dim) without a transpose.
        q = q.reshape(B, d.heads, 1, d.head_dim)
        k = k.reshape(B, d.kv_heads, 1, d.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = d.rope(self, q, positions), d.rope(self, k, positions)
        if q_scale is not None:
            q = q * q_scale
        keys, values = write(index, k, v.reshape(B, d.kv_heads, 1, d.head_dim))
        h = x + self.o_proj(attend(q, keys, values, self.scale, visible))
        gate, up = mx.split(self.gate_up(self.post_norm(h)), self.gate_up_split, axis=-1)
        return h + self.down_proj(swiglu(gate, up))
