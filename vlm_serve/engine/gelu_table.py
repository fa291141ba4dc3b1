"""GELU of 16-bit activations as one table lookup, to MLX's bits (on the CPU).

A bfloat16 or float16 activation has 65,536 possible values, so any elementwise
function of it is a table. At load, MLX's own GELU runs once over every value on the
device, and each GELU of the vision towers then gathers its outputs from that table.
On the CPU that is ~5x faster than MLX's chain of ops (``bench/gelu_table.py``). On CUDA
it is slower: MLX's gather took 70 ms of kernels for Gemma 3's tower over 16 images on an
H200, where MLX's two GELU kernels took 51 ms (``bench/results/gpu-h200-decode-phase``).
Metal has not been measured. So by default only the CPU uses the table;
``VLM_SERVE_GELU_TABLE=1`` uses it everywhere, ``0`` nowhere.

Each value gets MLX's bits by construction (the table holds MLX's results), as long as
MLX computes an element the same wherever it sits in an array. A check at load
compares the two on an array whose elements sit at other offsets and on a strided
view, and keeps MLX's ops where any bit differs.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger("vlm_serve.engine")

# "1": the table on any device; "0": MLX's ops everywhere; unset: the table on the CPU.
SETTING = os.environ.get("VLM_SERVE_GELU_TABLE")

DTYPES = (mx.bfloat16, mx.float16)
_tables: dict[tuple[str, mx.Dtype], mx.array | None] = {}  # (approximation, dtype) -> MLX's GELU of every value


def every_value(dtype: mx.Dtype) -> mx.array:
    """All 65,536 values of a 16-bit float type, in the order of their bits."""
    return mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(dtype)


def lookup(table: mx.array, x: mx.array) -> mx.array:
    return mx.take(table, x.view(mx.uint16))


def _same_anywhere(gelu: nn.GELU, table: mx.array, dtype: mx.Dtype) -> bool:
    """Whether MLX's op gives the table's bits with each value at other offsets in an
    array (past a few leading elements: vector lanes and tails) and in a strided view."""
    values = every_value(dtype)
    shifted = mx.concatenate([mx.zeros((7,), dtype), values])
    strided = values.reshape(256, 256).T
    return (mx.array_equal(gelu(shifted), lookup(table, shifted), equal_nan=True).item()
            and mx.array_equal(gelu(strided), lookup(table, strided), equal_nan=True).item())


def table_for(approx: str, dtype: mx.Dtype) -> mx.array | None:
    """MLX's GELU (``approx`` as ``nn.GELU`` takes it) of every ``dtype`` value, or None
    where a lookup would not give MLX's bits. Built on first call: call it at load,
    never inside a compiled trace."""
    key = (approx, dtype)
    if key not in _tables:
        gelu = nn.GELU(approx=approx)
        table = gelu(every_value(dtype))
        try:
            mx.eval(table)
            same = _same_anywhere(gelu, table, dtype)
        except Exception as exc:  # noqa: BLE001 - a lookup this backend cannot run: MLX's ops
            log.warning("GELU (%s, %s): MLX's ops (the lookup failed: %s)", approx, dtype, exc)
            same = None
        if same is False:
            log.warning("GELU (%s, %s): MLX's ops (its results depend on where a value sits)", approx, dtype)
        _tables[key] = table if same else None
    return _tables[key]


class _TableGELU(nn.GELU):
    def __call__(self, x):
        table = _tables.get((self._approx, x.dtype))
        return lookup(table, x) if table is not None else super().__call__(x)


def wanted_here() -> bool:
    if SETTING is not None:
        return SETTING != "0"
    return mx.default_device().type == mx.DeviceType.cpu


def install(model: nn.Module) -> int:
    """Point ``model``'s ``nn.GELU`` layers at a table for 16-bit inputs, in place (their
    tables built now). Returns how many."""
    if not wanted_here():
        return 0
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.GELU:
            for dtype in DTYPES:
                table_for(module._approx, dtype)
            module.__class__ = _TableGELU
            count += 1
    return count
