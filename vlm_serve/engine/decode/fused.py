"""Fusing linear layers that read the same input into one matmul.

The fused layer holds the concatenated weights (plain or quantized: quantization groups
run along the input dimension, so output rows concatenate as they are). The original
layers are then pointed at row slices of the fused arrays, which MLX keeps as views of
the same memory: the model's own forward pass (prefill) is unchanged and the weights
are held once.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import mlx.nn as nn

_PARAMS = ("weight", "scales", "biases", "bias")


def fuse_linears(linears: list[nn.Module]) -> tuple[nn.Module, list[int]]:
    """One layer computing ``concat([l(x) for l in linears], -1)``, and the split
    indices that cut its output back into theirs."""
    kinds = {type(layer) for layer in linears}
    if len(kinds) != 1 or not isinstance(linears[0], (nn.Linear, nn.QuantizedLinear)):
        raise TypeError(f"cannot fuse {sorted(k.__name__ for k in kinds)}")
    names = [n for n in _PARAMS if n in linears[0]]
    if any(set(n for n in _PARAMS if n in layer) != set(names) for layer in linears):
        raise TypeError("cannot fuse linear layers with different parameters")
    fused = copy.copy(linears[0])
    for name in names:
        fused[name] = mx.concatenate([layer[name] for layer in linears], axis=0)
    mx.eval(fused.parameters())
    rows = [layer["weight"].shape[0] for layer in linears]
    start = 0
    for layer, n in zip(linears, rows):
        for name in names:
            layer[name] = fused[name][start:start + n]
        start += n
    mx.eval([layer.parameters() for layer in linears])
    splits = [sum(rows[: i + 1]) for i in range(len(rows) - 1)]
    return fused, splits
