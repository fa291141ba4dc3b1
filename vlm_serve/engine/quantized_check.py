"""Once at load, off the CPU: MLX's quantized kernels against the weights they
dequantize to, for each shape of quantized layer the model runs on them.

On CUDA (MLX 0.32.4) a model of float32 activations and 4-bit weights answered in wrong
tokens: mlx-vlm's own generate gave token 0 at every step. A server would have served
those answers as if they were right. So where the device is not the CPU (whose kernels
are the reference here), each distinct quantized layer still on MLX's kernels (not on
the row-exact matmul) runs once on one and on 16 rows, and an embedding table looks up
some rows; each result is compared with the CPU's product of the dequantized weights.
A layer far off stops startup with its name, rather than the server answering wrong.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import row_exact

# Off by more than this fraction of the reference's largest magnitude: not rounding
# (a bfloat16 product is within ~1%), a wrong kernel.
TOLERANCE = 0.05
ROW_COUNTS = (1, 16)  # MLX picks a matrix-vector kernel for one row, a matmul for more


def check(model: nn.Module) -> None:
    """Raise ``RuntimeError`` naming the first quantized layer whose results on this
    device are far from the dequantized weights'; nothing on the CPU."""
    if on_cpu():
        return
    seen = set()
    for name, module in model.named_modules():
        table = isinstance(module, nn.QuantizedEmbedding)
        if not (table or isinstance(module, nn.QuantizedLinear)) or (row_exact.installed(module) and not table):
            continue
        key = (type(module), module.weight.shape, module.scales.dtype, module.group_size, module.bits,
               getattr(module, "mode", "affine"), "bias" in module)
        if key in seen:
            continue
        seen.add(key)
        for what, got, want in _cases(module):
            error = relative_error(got, want)
            if not error <= TOLERANCE:
                raise RuntimeError(
                    f"MLX's quantized kernels on {mx.default_device()} give wrong results for {name} "
                    f"({type(module).__name__}, {module.bits}-bit weights in groups of {module.group_size}, "
                    f"{str(module.scales.dtype).split('.')[-1]} activations, {what}): off by {error:.3g} of "
                    "the result's magnitude against the dequantized weights. This model cannot be served "
                    "correctly here; a checkpoint of other precision may be.")


def on_cpu() -> bool:
    """Whether MLX computes on the CPU here (whose kernels the check compares against)."""
    return mx.default_device() == mx.cpu


def _cases(module: nn.Module):
    """(what, this device's result, the CPU's from the dequantized weights) for
    ``module``, on a sample of its output columns (both ends, and some between)."""
    columns = sampled_columns(module.weight.shape[0])
    weights = dequantized_rows(module, columns)
    table = isinstance(module, nn.QuantizedEmbedding)
    if table:
        yield "a lookup", module(columns), weights
        if row_exact.installed(module):
            return  # read as the output layer on the row-exact matmul, not MLX's
    for rows in ROW_COUNTS:
        x = mx.random.normal((rows, weights.shape[1]), key=mx.random.key(rows)).astype(module.scales.dtype)
        got = (module.as_linear(x) if table else module(x))[:, columns]
        with mx.stream(mx.cpu):
            want = x.astype(mx.float32) @ weights.T
            if "bias" in module:
                want = want + module.bias[columns].astype(mx.float32)
        yield f"{rows} row{'s' if rows > 1 else ''}", got, want


def sampled_columns(outputs: int) -> mx.array:
    """Output columns to check a layer of ``outputs`` on: both ends, and some between
    (dequantizing a whole output layer would take gigabytes on the host)."""
    return mx.array(sorted({*range(min(outputs, 32)), *range(max(0, outputs - 32), outputs),
                            *range(0, outputs, max(1, outputs // 64))}))


def dequantized_rows(module: nn.Module, rows: mx.array) -> mx.array:
    """``rows`` of the module's weight, dequantized on the CPU, in float32."""
    with mx.stream(mx.cpu):
        biases = module.get("biases")
        return mx.dequantize(module.weight[rows], module.scales[rows], None if biases is None else biases[rows],
                             module.group_size, module.bits,
                             mode=getattr(module, "mode", "affine")).astype(mx.float32)


def relative_error(got: mx.array, want: mx.array) -> float:
    """Largest difference over the reference's largest magnitude, where the reference
    is a number (a random table may hold NaN); NaN where only ``got`` has NaN."""
    with mx.stream(mx.cpu):
        got, want = got.astype(mx.float32), want.astype(mx.float32)
        known = ~mx.isnan(want)
        if (mx.isnan(got) & known).any().item():
            return float("nan")
        scale = max(mx.where(known, mx.abs(want), 0).max().item(), 1e-6)
        return mx.where(known, mx.abs(got - want), 0).max().item() / scale
