"""A stream beside the default one, for index arithmetic that the model code computes
on the device and reads back.

A read waits for all the work queued on its stream before it. The towers' small index
computations (positions, interpolation weights) run on this stream instead, so reading
them back waits only for themselves; they run on the same device with the same kernels,
so they give the same bits.
"""

from __future__ import annotations

import threading

import mlx.core as mx

_local = threading.local()  # MLX's streams belong to the thread that made them


def side_stream() -> mx.Stream:
    """A stream of the default device beside its default stream: one per thread and
    device."""
    device = mx.default_device()
    streams = _local.__dict__.setdefault("streams", {})
    key = (str(device.type), getattr(device, "index", 0))
    if key not in streams:
        streams[key] = mx.new_stream(device)
    return streams[key]
