"""GLM-4V's vision tower without reads that wait behind queued device work.

mlx-vlm's tower reads the images' grids back (``.tolist()``), takes its rotary table's
length with ``.item()``, and reads its sequence bounds back in every layer. Each read
waits for all the work queued before it. Here the grids and bounds come from the host
(``qwen_tower``'s arithmetic: the same integers) and the model's own rotary function
runs on a side stream (``side_stream``); the layers, the position embedding, the
downsampling and the merger are the tower's own (``tests/test_glm4v_merge.py``).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .qwen_tower import sequence_bounds
from .side_stream import side_stream
from .tower_mixin import mix_in


class HostGridTower:
    """Mixed into the tower's own class (``install``): its ``__call__`` with the grids
    and bounds on the host and its rotary positions on a side stream."""

    def __call__(self, hidden_states: mx.array, grid_thw, output_hidden_states: Optional[bool] = None):
        grids = np.asarray(grid_thw).astype(np.int64)
        host_grids = mx.array(grids)  # made from host data: reading it back waits for nothing
        hidden_states = self.post_conv_layernorm(self.patch_embed(hidden_states))
        with mx.stream(side_stream()):
            rotary, patch_positions = self.rot_pos_emb(host_grids)
        bounds = sequence_bounds(grids)  # the attention reads its lengths with .tolist()
        # The lengths as NumPy: the embeddings make a list of them an mx.array, then read
        # each back with int().
        hidden_states = self.embeddings(hidden_states, np.diff(bounds), host_grids,
                                        patch_positions[:, 0], patch_positions[:, 1])
        for block in self.blocks:
            hidden_states = block(hidden_states, cu_seqlens=bounds, rotary_pos_emb=rotary)
        hidden_states = self.post_layernorm(hidden_states)
        merge = self.spatial_merge_size
        hidden_states = hidden_states.reshape(-1, merge, merge, hidden_states.shape[-1])
        hidden_states = self.downsample(hidden_states).reshape(-1, self.config.out_hidden_size)
        return self.merger(hidden_states)


TOWERS = ("mlx_vlm.models.glm4v.vision",)


def install(tower) -> bool:
    """Give ``tower``, where it is GLM-4V's ``VisionModel``, the host's grids and bounds,
    on this instance; returns whether it has them."""
    return mix_in(tower, HostGridTower, TOWERS)
