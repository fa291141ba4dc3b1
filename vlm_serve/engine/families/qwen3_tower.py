"""Qwen3-VL's vision tower without reads that wait behind queued device work.

mlx-vlm's tower reads the images' grids back (``.tolist()``, ``.item()``), works out its
position-embedding interpolation's indices and weights with device ops and reads those
back too (``.tolist()``), and reads its sequence bounds back in every layer. Each read
waits for all the work queued before it, so a tower call waited for every pass queued
before it. Here the grids and the bounds come from the host (``qwen_tower``'s
arithmetic), and the model's own two index functions run on a stream of their own: a
read there waits only for that stream's work, and the same kernels give the same bits
(``tests/test_qwen3_merge.py``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .qwen_tower import sequence_bounds
from .side_stream import side_stream
from .tower_mixin import mix_in


class SideStreamTower:
    """Mixed into the tower's own class (``install``): its ``__call__`` with the grids
    and bounds on the host and its index functions on a side stream; the layers, the
    patch embedding and the mergers its own."""

    def __call__(self, hidden_states: mx.array, grid_thw, **kwargs):
        grids = np.asarray(grid_thw).astype(np.int64)
        hidden_states = self.patch_embed(hidden_states)
        with mx.stream(side_stream()):
            host_grids = mx.array(grids)  # made from host data: reading it back waits for nothing
            positions = self.fast_pos_embed_interpolate(host_grids)
            rotary = self.rot_pos_emb(host_grids)
        hidden_states = hidden_states + positions
        length = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(length, -1)
        rotary = rotary.reshape(length, -1)
        bounds = sequence_bounds(grids)  # the attention reads [1:-1].tolist(): on the host
        deepstack = []
        for number, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, cu_seqlens=bounds, rotary_pos_emb=rotary)
            if number in self.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.deepstack_visual_indexes.index(number)]
                deepstack.append(merger(hidden_states))
        return self.merger(hidden_states), deepstack


TOWERS = ("mlx_vlm.models.qwen3_vl.vision",)


def install(tower) -> bool:
    """Give ``tower``, where it is Qwen3-VL's ``VisionModel``, the host's grids and the
    side stream, on this instance; returns whether it has them."""
    return mix_in(tower, SideStreamTower, TOWERS)
