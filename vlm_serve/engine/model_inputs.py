"""A prepared request's model inputs as MLX arrays, made on the worker.

Pixels that come as uint8 values with a table (``preprocess.packed_pixels``) are looked
up on the device: the copy to it is a quarter of float32's, and the floats are the
image processor's own, bit for bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .types import PreparedRequest


def model_arrays(request: PreparedRequest, leave_out: tuple[str, ...] = ()) -> dict:
    """``request.model_inputs`` as mx.arrays (a list stays a list), but for the names
    in ``leave_out``."""
    return {
        name: _array(value, request.pixel_table if name == "pixel_values" else None)
        for name, value in request.model_inputs.items() if name not in leave_out
    }


def _array(value, table: np.ndarray | None):
    if isinstance(value, list):
        return [_array(v, table) for v in value]
    return mx.array(value) if table is None else unpacked(value, table)


def unpacked(values: np.ndarray, table: np.ndarray) -> mx.array:
    """The floats of channels-first uint8 ``values`` (..., channels, height, width):
    each value looked up in its channel's row of ``table``."""
    channels = table.shape[0]
    rows = mx.arange(0, channels * 256, 256, dtype=mx.int32).reshape(channels, 1, 1)
    return mx.take(mx.array(table).reshape(-1), mx.array(values).astype(mx.int32) + rows)
