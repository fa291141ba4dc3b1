"""Llama 3.2 Vision (mllama): cross-attention to image states, served one row at a time.

Batching it exactly is not possible on mlx-vlm's model code: a text-only request runs
its cross-attention layers on a stand-in built from its own queries (attention over the
whole prompt, unmasked), which no padded batch reproduces, and image rows carry
cross-attention states of different lengths. One row at a time gives each request
exactly what mlx-vlm's own generate gives it.
"""

from __future__ import annotations

from .base import SerialFamily


class Mllama(SerialFamily):
    name = "mllama"
    reason = (
        "cross-attention: mlx-vlm's text-only path attends without a mask and cannot be "
        "reproduced inside a padded batch"
    )
