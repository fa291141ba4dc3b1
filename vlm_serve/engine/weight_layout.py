"""Weights laid out for the CPU backend's matmul.

On MLX's CPU backend a float32 matmul goes through BLAS. The Linux wheels bundle the
reference BLAS, whose sgemm is 1.3-2.7x faster when the right-hand operand is contiguous
in (in, out) order than when it is the transposed view ``W.T`` of an (out, in) weight,
which is what every ``nn.Linear`` multiplies by (on a 2-core x86 CPU: 16x64 by 64x838 in
0.70 against 0.91 ms, 300x64 by 64x192 in 1.7 against 4.6 ms). Both orders add each
dot product's terms in the same sequence, so the results are the same to the bit.

So on the CPU, each float32 linear and embedding weight is stored once in (in, out)
order, and the module holds the (out, in) transposed view of it: the model's own
``x @ W.T`` then reads the contiguous array, and nothing else changes (an embedding
gathers its rows from the view). bfloat16 and float16 take MLX's own kernels, which
run as fast either way; quantized layers keep their packed weights. Other backends
keep the checkpoint's layout.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("vlm_serve.engine")


def wants_input_major() -> bool:
    """Whether matmuls on the default device run faster on (in, out) weights."""
    return mx.default_device().type == mx.DeviceType.cpu


def for_matmul(weight: mx.array) -> mx.array:
    """An (out, in) weight as the backend multiplies it fastest: the same values, as
    the transposed view of an (in, out) copy where that is faster, else ``weight``."""
    if weight.dtype != mx.float32 or weight.ndim != 2 or not wants_input_major():
        return weight
    laid_out = mx.contiguous(weight.T).T
    mx.eval(laid_out)  # one weight at a time: the old one is freed as its module lets go
    return laid_out


def lay_out(model: nn.Module) -> int:
    """Give every float32 linear and embedding weight of ``model`` the layout of
    ``for_matmul``, in place; a weight that several modules share (a tied output layer)
    stays shared. Returns how many weights were laid out anew."""
    if not wants_input_major():
        return 0
    # Grouped first, while every weight is alive (so ids are unique); then each group
    # is laid out and its old array freed before the next.
    sharing: dict[int, list[nn.Module]] = {}
    for _, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and "weight" in module:
            sharing.setdefault(id(module.weight), []).append(module)
    changed = 0
    for modules in sharing.values():
        weight = modules[0].weight
        laid_out = for_matmul(weight)
        changed += laid_out is not weight
        for module in modules:
            module.weight = laid_out
    if changed:
        log.info("laid out %d float32 weights input-major for the CPU's matmul", changed)
    return changed
