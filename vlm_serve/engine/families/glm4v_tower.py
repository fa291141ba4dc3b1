"""GLM-4V's vision tower without reads that wait behind queued device work.

mlx-vlm's tower reads the images' grids back (``.tolist()``), takes its rotary table's
length with ``.item()``, and reads its sequence bounds back in every layer. Each read
waits for all the work queued before it. Here the grids and bounds come from the host
(``qwen_tower``'s arithmetic: the same integers) and the model's own rotary function
runs on a side stream (``side_stream``); the layers, the position embedding, the
downsampling and the merger are the tower's own (``tests/test_glm4v_merge.py``).

Its attention also drops the empty pieces of its sequence. The model code splits the
sequence after the first image and after the second (the rest attend together), so one
image leaves two empty pieces; attention over an empty piece adds nothing, but in
bfloat16 on CUDA it ends the process with SIGFPE (as Qwen2.5-VL's empty windows did).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_vlm.models.glm4v.vision import apply_rotary_pos_emb_vision

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


class NonEmptyPiecesAttention:
    """Mixed into each block's attention (``install``): its ``__call__`` with the model
    code's pieces (the first image, the second, the rest), the empty ones left out."""

    def __call__(self, x: mx.array, cu_seqlens, rotary_pos_emb: mx.array = None) -> mx.array:
        length = x.shape[0]
        qkv = self.qkv(x).reshape(length, 3, self.num_heads, -1).transpose(1, 0, 2, 3)
        q, k, v = mx.split(qkv, 3)
        q = apply_rotary_pos_emb_vision(mx.expand_dims(q, 0), rotary_pos_emb)[0]
        k = apply_rotary_pos_emb_vision(mx.expand_dims(k, 0), rotary_pos_emb)[0]
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        lengths = np.diff(np.asarray(cu_seqlens)).tolist()
        edges = [0, lengths[0], sum(lengths[:2]), length]
        pieces = [mx.fast.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                       scale=self.scale, mask=None)
                  for a, b in zip(edges, edges[1:]) if b > a]
        output = mx.concatenate(pieces, axis=2).transpose(0, 2, 1, 3).reshape(length, -1)
        return self.proj(output)


TOWERS = ("mlx_vlm.models.glm4v.vision",)


def install(tower) -> bool:
    """Give ``tower``, where it is GLM-4V's ``VisionModel``, the host's grids and bounds
    and attention without empty pieces, on this instance; returns whether it has them."""
    if not mix_in(tower, HostGridTower, TOWERS):
        return False
    return all(mix_in(block.attn, NonEmptyPiecesAttention, TOWERS) for block in tower.blocks)
