"""On CUDA, a row's bits whatever else shares its batch.

On the CPU, MLX's operations give a row the same bits in a batch as alone, and the
parity suite proves it on every commit. On CUDA its matmuls do not: they choose their
kernel by the number of rows (``cuda_matmul``). So on CUDA, once at load:

- every linear layer of the language model, and an embedding table read as the output
  layer, multiplies so that each dot product's terms are added in one order whatever
  the row count (below). The family's decode step calls the same product (``decode.
  fused.StepLinear``);
- the attention of mlx-vlm's language model code (every family's prefill but Gemma
  3's, which has its own) runs on the engine's attention kernel (``model_attention``);
- requests' images share vision-tower calls only of sizes checked at first use to
  keep each image's bits (``tower_sharing``; the tower's convolutions and matmuls
  choose their kernels by batch too), else each request's go in a call of their own;
- a model with a linear layer the row-exact kernel cannot take (another quantization
  format, a layer class of its own) is served one row at a time, and says so.

A tensor-parallel rank's row-sharded layers (``ShardedToAllLinear``) take that product
for their own part, then sum the group's in an order that does not follow
the row count (``_group_sum``).

How each layer shape multiplies is chosen by ``VLM_SERVE_MATMUL``:

- ``padded`` (the default): MLX's own matmul, each pass padded with zero rows to a size
  from which a check at load finds that it keeps a row's bits (``padded_matmul``); a
  shape without such a size takes the row-exact kernel (``cuda_matmul.linear``, which
  adds the terms in one order at any row count). Much faster on long passes (prefill)
  and at many rows a step; slower for a lone request, whose step pays for the padding
  (``bench/results/gpu-h100-padded-matmul``);
- ``exact``: the row-exact kernel for every layer (a lone request decodes faster);
- ``mlx``: MLX's matmul as it is, for comparison only: batched rows then drift from
  their tokens alone.

Prefill and decode multiply with the same function for each shape: a cached prefix's
keys and values, whichever computed them, must be the ones a prefill would compute.
(Padded prefill with decode steps on the kernel was tried, and lost to one of the two
ways above at every load measured: ``bench/results/gpu-h200-padded-default``.)
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedShardedToAllLinear, ShardedToAllLinear

from . import cuda_matmul, model_attention, padded_matmul

log = logging.getLogger("vlm_serve.engine")

_MATMUL = os.environ.get("VLM_SERVE_MATMUL", "padded")
if _MATMUL not in ("padded", "exact", "mlx"):
    raise ValueError(f"VLM_SERVE_MATMUL={_MATMUL!r}: expected padded, exact or mlx")
_USE_KERNEL = _MATMUL != "mlx"
_PADDED = _MATMUL == "padded"


def _row_exact_product(x, module, weight_t=None):
    """``module``'s product with each row's bits independent of the other rows: MLX's
    matmul on padded passes where that was checked for its shape (by ``weight_t`` where
    given, ``padded_matmul.transposed``), else the kernel."""
    floor = padded_matmul.floor_of(module) if _PADDED else None
    if floor is not None:
        return padded_matmul.linear(x, module, floor, weight_t)
    return cuda_matmul.linear(x, module)


def _row_exact(self, x):
    """The layer's product, row-exact (its call, or a table's ``as_linear``)."""
    return _row_exact_product(x, self)


class _ExactLinear(nn.Linear):
    __call__ = _row_exact


class _ExactQuantizedLinear(nn.QuantizedLinear):
    __call__ = _row_exact


class _ExactEmbedding(nn.Embedding):
    as_linear = _row_exact


class _ExactQuantizedEmbedding(nn.QuantizedEmbedding):
    as_linear = _row_exact


def _group_sum(x: mx.array, group) -> mx.array:
    """The group's sum of each rank's ``x``. Two ranks' all-reduce is exact (``a + b ==
    b + a``); with more, NCCL's all-reduce may order each sum by message size, so the
    ranks' parts are gathered and added in rank order."""
    if group.size() <= 2:
        return mx.distributed.all_sum(x, group=group)
    parts = mx.distributed.all_gather(x[None], group=group)  # (ranks, ...)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _sharded_to_all(self, x):
    """A row-sharded layer's partial product, row-exact, then the group's sum."""
    x = _group_sum(_row_exact_product(x, self), self.group)
    return x + self["bias"] if "bias" in self else x


class _ExactShardedToAllLinear(ShardedToAllLinear):
    __call__ = _sharded_to_all


class _ExactQuantizedShardedToAllLinear(QuantizedShardedToAllLinear):
    __call__ = _sharded_to_all


_EXACT = {
    nn.Linear: _ExactLinear,
    nn.QuantizedLinear: _ExactQuantizedLinear,
    nn.Embedding: _ExactEmbedding,
    nn.QuantizedEmbedding: _ExactQuantizedEmbedding,
    # A tensor-parallel rank's row-sharded layers: its partial product, then the sum.
    ShardedToAllLinear: _ExactShardedToAllLinear,
    QuantizedShardedToAllLinear: _ExactQuantizedShardedToAllLinear,
}


def applies() -> bool:
    """Whether this device needs the row-exact matmul (MLX's CUDA backend)."""
    return _USE_KERNEL and cuda_matmul.available()


def installed(module: nn.Module) -> bool:
    """Whether ``module`` runs on the row-exact matmul (``install``)."""
    return type(module) in _EXACT.values()


# Installed layers whose call is their product alone (a row-sharded layer's adds the
# group's sum), and tables, whose ``as_linear`` is.
_PRODUCT_ONLY = (_ExactLinear, _ExactQuantizedLinear)
_TABLES = (_ExactEmbedding, _ExactQuantizedEmbedding)


def step_call(module: nn.Module, tied: bool = False):
    """An installed layer's call for a decode step (a table's ``as_linear`` where
    ``tied``), with ``W.T`` taken once, at build, for the padded product: otherwise a
    node of every step (``padded_matmul.transposed``)."""
    if not (_PADDED and type(module) in (_TABLES if tied else _PRODUCT_ONLY)):
        return module.as_linear if tied else module
    weight_t = padded_matmul.transposed(module)
    return lambda x: _row_exact_product(x, module, weight_t)


def prepare(module: nn.Module) -> None:
    """Make the load-time choices for an installed layer's product (where padded, its
    shape's check), so that none is made inside a compiled step."""
    if _PADDED:
        padded_matmul.floor_of(module)


def install(language_model: nn.Module) -> list[str]:
    """Point the language model's linear layers (and embedding tables, as output
    layers) at the row-exact product, in place. Returns the names of linear layers the
    kernel cannot take (each layer needs it, for a shape with no padded size); an
    embedding table counts only where no ``lm_head`` is there to read instead. The
    model code's attention takes the engine's kernel too."""
    model_attention.route(language_model)
    modules = dict(language_model.named_modules())
    tied = not any(name.split(".")[-1] == "lm_head" for name in modules)
    left = []
    for name, module in modules.items():
        # Mixture-of-experts layers (mlx-lm's SwitchLinear) multiply through MLX's
        # gathered matmuls, which the kernel does not replace.
        experts = "SwitchLinear" in type(module).__name__
        linear = experts or isinstance(module, (nn.Linear, nn.QuantizedLinear, ShardedToAllLinear,
                                                QuantizedShardedToAllLinear))
        table = isinstance(module, (nn.Embedding, nn.QuantizedEmbedding))
        if not (linear or table) or installed(module):
            continue
        dtype = module.scales.dtype if "scales" in module else module.weight.dtype
        if not experts and type(module) in _EXACT and cuda_matmul.fits(module, dtype):
            module.__class__ = _EXACT[type(module)]
            prepare(module)
        elif linear or tied:
            left.append(name or type(module).__name__)
    if _PADDED:
        log.info("CUDA: MLX's matmul on padded passes where checked: %s", padded_matmul.describe())
    return left
