"""The decode step of Qwen2-VL, Qwen2.5-VL and Qwen3-VL's language models: the
Llama-shaped step (``llama.py``, with Qwen3's q/k RMSNorm) with their positions.

At decode time a row's three mRoPE axes all hold the same position (its token count
plus the row's ``rope_delta``, which an image in its prompt sets), and 3-axis rotary
embedding with equal positions is the ordinary rotary embedding at that position: one
``mx.fast.rope`` per tensor with a per-row offset, instead of cos/sin tables applied by
hand.
"""

from __future__ import annotations

import mlx.core as mx

from .llama import LlamaDecoder


class Qwen2Decoder(LlamaDecoder):
    def __init__(self, model):
        self.rope_base = float(model.language_model.args.rope_theta)
        super().__init__(model)

    def rope(self, layer, x: mx.array, positions: mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.head_dim, traditional=False, base=self.rope_base, scale=1.0,
            offset=positions,
        )
