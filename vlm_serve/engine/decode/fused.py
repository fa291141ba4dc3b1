"""Linear layers for the decode step: fused where they read the same input, and called
without a per-step transpose.

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

from .. import row_exact
from ..weight_layout import for_matmul

_PARAMS = ("weight", "scales", "biases", "bias")


class StepLinear:
    """``module(x)`` for a decode step. A plain layer's ``x @ W.T`` adds a transpose node
    to every step's graph; here ``W.T`` is taken once (an evaluated view of the same
    memory, so the matmul and its result are the same). Quantized layers transpose
    inside their kernel already and are called as they are. ``tied`` reads an embedding
    table as the output layer, as ``Embedding.as_linear`` does. On CUDA a layer on the
    row-exact matmul takes that product (``row_exact.step_call``), where padded with
    ``W.T`` taken once as well."""

    def __init__(self, module: nn.Module, tied: bool = False):
        self.module = module
        self.call = module.as_linear if tied else module
        self.weight_t = self.bias = None
        if row_exact.installed(module):
            row_exact.prepare(module)  # a fused layer's shape is new to the checks
            self.call = row_exact.step_call(module, tied)  # the row-exact product
            return
        if isinstance(module, (nn.Linear, nn.Embedding)) and not isinstance(
            module, (nn.QuantizedLinear, nn.QuantizedEmbedding)
        ):
            self.weight_t = module.weight.T
            self.bias = module.bias if "bias" in module else None
            mx.eval(self.weight_t)

    def __call__(self, x: mx.array) -> mx.array:
        if self.weight_t is None:
            return self.call(x)
        if self.bias is not None:
            return mx.addmm(self.bias, x, self.weight_t)
        return x @ self.weight_t


def fuse_linears(linears: list[nn.Module]) -> tuple[StepLinear, list[int]]:
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
    if "weight" in fused:
        fused["weight"] = for_matmul(fused["weight"])
    mx.eval(fused.parameters())
    rows = [layer["weight"].shape[0] for layer in linears]
    start = 0
    for layer, n in zip(linears, rows):
        for name in names:
            layer[name] = fused[name][start:start + n]
        start += n
    mx.eval([layer.parameters() for layer in linears])
    splits = [sum(rows[: i + 1]) for i in range(len(rows) - 1)]
    return StepLinear(fused), splits
