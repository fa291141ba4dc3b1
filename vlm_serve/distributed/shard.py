"""Splitting a vision-language model's language model across a tensor-parallel group.

As mlx-lm shards its models (Megatron-style): in every decoder layer the query, key and
value projections and the MLP's gate and up projections keep a slice of their output
rows on each rank ("all-to-sharded": each rank holds whole heads and a slice of the
MLP), and the attention output and MLP down projections a slice of their input columns
("sharded-to-all": each rank's partial product is summed across the group, one
all-reduce per attention block and one per MLP). Embeddings, norms and the LM head are
replicated, as mlx-lm leaves them.

q/k/v/gate/up are sharded in place (``shard_inplace``): they stay plain ``Linear`` (or
``QuantizedLinear``) layers with fewer rows, so the engine's decode step still fuses
them per rank, and the attention modules' head counts are divided so that both the
model code (prefill) and the decode step reshape to the rank's own heads. o/down become
mlx's ``ShardedToAllLinear`` (the all-reduce inside), which the decode step calls as
modules. This runs before the family builds its decoder.

The vision tower is not split: every rank runs it on the request's pixels (they come
with the plan), so prefill needs nothing from rank 0 and no image features cross the
network. Its weights are a small share of a large model's (0.7 B of Qwen2.5-VL-72B's
73 B) and it runs on every rank at once, so replicating it costs memory, not time.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear

# Model types whose tensor-parallel tokens are checked against one device's (tests and
# the layouts below); others are refused rather than served unverified.
VERIFIED = {"gemma3", "qwen2_vl", "qwen2_5_vl"}


class CannotShard(ValueError):
    pass


def decoder_layers(language_model) -> list:
    inner = getattr(language_model, "model", language_model)
    layers = getattr(inner, "layers", None)
    if not layers:
        raise CannotShard("no decoder layers found on the language model")
    return list(layers)


def check(model, size: int) -> None:
    """Refuse, before anything is split, a model this group cannot shard evenly."""
    model_type = str(getattr(model.config, "model_type", ""))
    if model_type not in VERIFIED:
        raise CannotShard(
            f"tensor parallel is not verified for model type {model_type!r} "
            f"(verified: {', '.join(sorted(VERIFIED))})")
    for i, layer in enumerate(decoder_layers(model.language_model)):
        attn, mlp = layer.self_attn, layer.mlp
        for name in ("n_heads", "n_kv_heads"):
            if getattr(attn, name) % size:
                raise CannotShard(f"layer {i}: {name}={getattr(attn, name)} does not divide "
                                  f"into {size} ranks")
        width = mlp.gate_proj.weight.shape[0]
        if width % size:
            raise CannotShard(f"layer {i}: MLP width {width} does not divide into {size} ranks")
        for name, linear in (("o_proj", attn.o_proj), ("down_proj", mlp.down_proj)):
            # A quantized layer split along its input splits its quantization groups.
            if isinstance(linear, nn.QuantizedLinear):
                groups = linear.scales.shape[-1]
                if groups % size:
                    raise CannotShard(
                        f"layer {i}: {name} has {groups} quantization groups per row, which do "
                        f"not divide into {size} ranks (a smaller --q-group-size would)")


def shard_language_model(model, group: mx.distributed.Group) -> None:
    """Shard ``model.language_model`` in place across ``group`` (lazily: nothing is
    evaluated, so a lazily loaded checkpoint only ever materialises this rank's part)."""
    size = group.size()
    check(model, size)
    for layer in decoder_layers(model.language_model):
        attn, mlp = layer.self_attn, layer.mlp
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj):
            shard_inplace(linear, "all-to-sharded", group=group)
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
        attn.n_heads //= size
        attn.n_kv_heads //= size


def parameter_bytes(module: nn.Module) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))
