"""The decode step of Ministral 3 text models (Mistral 3 / Magistral 2512 checkpoints):
the Llama-shaped step (``llama.py``) with sliding-window layers beside full ones, and
Llama 4 attention scaling: each row's rotated queries are multiplied by
``1 + beta * log(1 + floor(position / original_max_position_embeddings))``.

mlx-vlm's model code computes that factor from ``cache[0].offset``, which on a batch
cache is the first row's position, so rows at other positions decode with the first
row's factor there. Here each row gets the factor of its own position.

The factor takes one value per ``floor(position / N)``. Those values are computed once,
by the model's own function (so they are its floats, whatever its ``log`` rounds to),
and each step sends the rows' values as one small array: nothing of it is in the step's
graph but the multiply, and nothing is read back.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_vlm.models.mistral4.language import _get_llama_4_attn_scale

from .llama import LlamaDecoder
from .store import LayerKind, SlotStore


class Ministral3Decoder(LlamaDecoder):
    def __init__(self, model):
        text = model.language_model.model
        if type(text).__name__ != "Ministral3":
            raise TypeError(f"{type(text).__name__} is not a Ministral 3 text model")
        params = text.config.rope_parameters
        self.beta = params["llama_4_scaling_beta"]
        self.period = params["original_max_position_embeddings"]
        self.level_scales: list[float] = []  # the factor of floor(position / period) = i
        self._add_levels()  # at load: a step never waits on reading them back
        super().__init__(model)

    def layer_kinds_of(self, text) -> list[LayerKind]:
        return [LayerKind(text.sliding_window if layer.use_sliding else None)
                for layer in text.layers]

    def step_inputs(self, store: SlotStore) -> tuple:
        # A row's position is its token count (the model's cache offset).
        # floor(position / period) as the model computes it: float32 division, floored.
        positions = np.array(store.lengths, np.float32)
        levels = np.floor(positions / np.float32(self.period)).astype(int).tolist()
        while max(levels) >= len(self.level_scales):
            self._add_levels()
        scales = store.per_slot([self.level_scales[level] for level in levels], 1.0)  # free: never read
        return (mx.array(scales, mx.float32),)

    def _add_levels(self, count: int = 16) -> None:
        """The factors of the next ``count`` levels, each from the model's own function
        at the level's first position (float32, before the model's cast)."""
        start = len(self.level_scales)
        self.level_scales += [
            _get_llama_4_attn_scale(p, p + 1, self.beta, self.period).item()
            for p in range(start * self.period, (start + count) * self.period, self.period)
        ]
