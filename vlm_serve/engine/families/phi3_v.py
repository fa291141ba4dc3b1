"""Phi-3.5-vision (phi3_v): served one row at a time.

Its LongRoPE picks short or long rotary factors from the longest row of the batch (past
4,096 positions every row switches), so a short request batched beside a long one would
not get the tokens it gets alone.
"""

from __future__ import annotations

from .base import SerialFamily


class Phi3V(SerialFamily):
    name = "phi3_v"
    reason = "LongRoPE chooses its rotary factors from the longest row of a batch"
