"""Gemma 4's decode step on the slot store, for the dense text models, with mlx-vlm's
weights and numerics.

The same computation as mlx-vlm's Gemma 4 language model for one new token per row,
op for op in its order and dtypes, so a row batched computes what it computes alone.
Beside what Gemma 3's step does (``gemma3.py``: masks and offsets once per step, fused
q/k/v and gate/up matmuls, 2-D activations), Gemma 4 has:

- per-layer inputs: a second embedding of the token and a projection of its embedding,
  normed and mixed once per step, then gated into every layer's output;
- KV-shared layers: the last ``num_kv_shared_layers`` read the keys/values of the last
  earlier layer of their type and write none, so the store holds only the layers before
  them (the model's own caches are those too);
- wider heads on full-attention layers (``global_head_dim``, and with
  ``attention_k_eq_v`` their own kv head count): the store takes a head shape per kind;
- values RMS-normed without a scale; with ``attention_k_eq_v`` (full layers) the values
  are the raw key projection;
- RoPE from each layer's own module (partial/proportional on full layers);
- norms that scale by their weight as it is (no ``1 + w``), a per-layer scalar, final
  logit soft-capping, attention scale 1.

On CUDA the residual add after attention and the norms on either side of it run as one
kernel (``cuda_norms``), which gives a row the same bits batched as alone.

The mixture-of-experts variant (``enable_moe_block``) is not reproduced here: its
constructor raises TypeError and the family decodes through the model code.
"""

from __future__ import annotations

import mlx.core as mx
from mlx.nn import gelu_approx
from mlx_vlm.models.gemma4.language import geglu, logit_softcap

from .attention import attend
from .cuda_norms import add_norm
from .fused import StepLinear, fuse_linears
from .step import KVWriter, StepDecoder
from .store import LayerKind


class Gemma4Decoder(StepDecoder):
    def __init__(self, model):
        self.lm = model.language_model
        text = self.lm.model
        config = text.config
        if getattr(config, "enable_moe_block", False):
            raise TypeError("Gemma 4 mixture-of-experts layers decode through the model code")
        self.eps = config.rms_norm_eps
        self.embed = text.embed_tokens
        self.embed_scale = text.embed_scale  # a Python float, as the model multiplies by
        # Layers [0, owners) write KV (one store layer each, as the model's caches); each
        # later layer reads the KV of layer ``sources[i]``.
        owners = text.first_kv_shared_layer_idx
        self.sources = list(text.previous_kvs)
        kinds = []
        for block in text.layers[:owners]:
            attn = block.self_attn
            window = text.window_size if attn.is_sliding else None
            kinds.append(LayerKind(window, attn.n_kv_heads, attn.head_dim))
        self.layers = [_Layer(block, self.eps, shares=i >= owners)
                       for i, block in enumerate(text.layers)]
        self.per_layer = _PerLayerInputs(text) if text.hidden_size_per_layer_input else None
        self.final_norm = text.norm.weight
        self.head = StepLinear(text.embed_tokens, tied=True)
        self.softcap = self.lm.final_logit_softcapping
        first = text.layers[0].self_attn  # head counts from the layer (a sharded one has fewer)
        super().__init__(kinds, first.n_heads, first.n_kv_heads, first.head_dim)

    def forward(self, tokens, positions, indices, visible, keys, values):
        h = self.embed(tokens)  # (slots, hidden): 3-D would cost each matmul a reshape
        h = h * self.embed_scale
        per_layer = self.per_layer(tokens, h, len(self.layers)) if self.per_layer else None
        write = KVWriter(self, indices, keys, values)
        kvs = {}  # layer -> the keys/values it attended to, for the layers sharing them
        for i, layer in enumerate(self.layers):
            source = self.sources[i]
            seen = visible[self.kind_index[source]]
            pli = per_layer[i] if per_layer is not None else None
            h, kvs[i] = layer(h, positions, seen, write, i, kvs.get(source), pli)
        h = mx.fast.rms_norm(h, self.final_norm, self.eps)
        logits = self.head(h)
        if self.softcap is not None:
            logits = logit_softcap(self.softcap, logits)
        return logits, write.keys, write.values


class _PerLayerInputs:
    """Every layer's per-layer input of this step's tokens, as the model's
    ``get_per_layer_inputs`` then ``project_per_layer_inputs`` make them."""

    def __init__(self, text):
        self.embed = text.embed_tokens_per_layer
        self.embed_scale = text.embed_tokens_per_layer_scale
        self.projection = StepLinear(text.per_layer_model_projection)
        self.projection_scale = text.per_layer_projection_scale
        self.norm = text.per_layer_projection_norm.weight
        self.input_scale = text.per_layer_input_scale
        self.size = text.hidden_size_per_layer_input
        self.eps = text.per_layer_projection_norm.eps

    def __call__(self, tokens: mx.array, h: mx.array, layers: int) -> list[mx.array]:
        rows = tokens.shape[0]
        embedded = (self.embed(tokens) * self.embed_scale).reshape(rows, layers, self.size)
        projected = (self.projection(h) * self.projection_scale).reshape(rows, layers, self.size)
        projected = mx.fast.rms_norm(projected, self.norm, self.eps)
        mixed = (projected + embedded) * self.input_scale
        # One split into the layers' (rows, size) inputs, not a slice and squeeze each.
        return mx.split(mixed.reshape(rows, layers * self.size), layers, axis=-1)


class _Layer:
    def __init__(self, block, eps: float, shares: bool):
        attn = block.self_attn
        if block.enable_moe:
            raise TypeError("a mixture-of-experts layer")
        self.eps = eps
        self.heads, self.kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.scale = attn.scale
        self.rope = attn.rope
        self.shares = shares  # reads an earlier layer's keys/values, writes none
        self.norms = {
            name: getattr(block, name).weight
            for name in (
                "input_layernorm", "post_attention_layernorm",
                "pre_feedforward_layernorm", "post_feedforward_layernorm",
            )
        }
        self.q_norm = attn.q_norm.weight
        if shares:
            self.q_proj = StepLinear(attn.q_proj)
        else:
            self.k_norm = attn.k_norm.weight
            # attention_k_eq_v: no value projection, the values are the raw keys.
            self.k_is_v = attn.use_k_eq_v
            projections = [attn.q_proj, attn.k_proj] + ([] if self.k_is_v else [attn.v_proj])
            self.qkv, self.qkv_split = fuse_linears(projections)
        self.gate_up, self.gate_up_split = fuse_linears([block.mlp.gate_proj, block.mlp.up_proj])
        self.o_proj = StepLinear(attn.o_proj)
        self.down_proj = StepLinear(block.mlp.down_proj)
        self.per_layer_gate = self.per_layer_projection = None
        if block.per_layer_input_gate is not None:
            self.per_layer_gate = StepLinear(block.per_layer_input_gate)
            self.per_layer_projection = StepLinear(block.per_layer_projection)
            self.norms["post_per_layer_input_norm"] = block.post_per_layer_input_norm.weight
        self.layer_scalar = block.layer_scalar

    def _norm(self, name: str, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.norms[name], self.eps)

    def __call__(self, x, positions, visible, write: KVWriter, index: int, shared_kv, pli):
        B = x.shape[0]
        h = self._norm("input_layernorm", x)
        # One token per row: (B, heads * dim) is (B, heads, 1, dim) without a transpose.
        if self.shares:
            q = self.q_proj(h)
            keys, values = shared_kv
        else:
            parts = mx.split(self.qkv(h), self.qkv_split, axis=-1)
            q, k = parts[0], parts[1]
            v = k if self.k_is_v else parts[2]
            k = mx.fast.rms_norm(k.reshape(B, self.kv_heads, 1, -1), self.k_norm, self.eps)
            k = self.rope(k, offset=positions)
            v = mx.fast.rms_norm(v.reshape(B, self.kv_heads, 1, -1), None, self.eps)
            keys, values = write(index, k, v)
        q = mx.fast.rms_norm(q.reshape(B, self.heads, 1, -1), self.q_norm, self.eps)
        q = self.rope(q, offset=positions)
        r = self.o_proj(attend(q, keys, values, self.scale, visible))
        # The residual add and the norms on either side of it: one kernel on CUDA.
        h, normed = add_norm(x, r, self.norms["post_attention_layernorm"],
                             self.norms["pre_feedforward_layernorm"], self.eps)
        gate, up = mx.split(self.gate_up(normed), self.gate_up_split, axis=-1)
        r = self.down_proj(geglu(gate, up))
        h = h + self._norm("post_feedforward_layernorm", r)
        if self.per_layer_gate is not None and pli is not None:
            g = gelu_approx(self.per_layer_gate(h))
            g = self.per_layer_projection(mx.multiply(g, pli))
            h = h + self._norm("post_per_layer_input_norm", g)
        if self.layer_scalar is not None:
            h = h * self.layer_scalar
        return h, (keys, values)
