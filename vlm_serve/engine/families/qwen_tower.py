"""Qwen2-VL's and Qwen2.5-VL's vision towers with their index arithmetic on the host.

mlx-vlm's towers work out each image's rotary positions, the sequence bounds their
attention splits at, and Qwen2.5-VL's windows from the images' (t, h, w) grids with
device ops, then read them back (``.item()``, ``.tolist()``, ``int()``): the bounds
once in every layer, each read after the layers before it have run. Each read waits
for all the work queued before it, so a tower call went layer by layer behind the
device, and behind every pass queued before it. The grids are the processor's, on the
host: here the same integers come from them with NumPy, and the device gets only the
gathers and the layers. Same values: these are index computations, and the layers run
as before (``tests/test_qwen_tower.py``).

Qwen2.5-VL's windows also lose their empty ones: mlx-vlm means to drop a window bound
that repeats (one per padded window) but compares ``mx.array`` scalars by identity, so
none are dropped; on the CPU an empty window is harmless, with bfloat16 on CUDA it ends
the process with SIGFPE. An empty window attends to nothing, so dropping it changes no
value.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from .tower_mixin import mix_in


def rotary_positions(grids: np.ndarray, merge: int) -> np.ndarray:
    """(patches, 2): each patch's (row, column) in its image, patches in the tower's
    order (merge x merge blocks together), as the towers' ``rot_pos_emb``."""
    positions = []
    for t, h, w in grids.tolist():
        rows = np.repeat(np.arange(h)[:, None], w, axis=1)
        columns = np.repeat(np.arange(w)[None, :], h, axis=0)
        blocks = [a.reshape(h // merge, merge, w // merge, merge).transpose(0, 2, 1, 3).reshape(-1)
                  for a in (rows, columns)]
        positions.append(np.tile(np.stack(blocks, axis=-1), (t, 1)))
    return np.concatenate(positions)


def sequence_bounds(grids: np.ndarray) -> np.ndarray:
    """Where each image's frames start and end in the tower's sequence (0 first), int32."""
    lengths = np.repeat(grids[:, 1] * grids[:, 2], grids[:, 0])
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def windows(grids: np.ndarray, window: int, merge: int, unit: int) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2.5-VL's ``get_window_index``: the merged patches in window order, and the
    windows' bounds in the sequence, without repeats (empty windows dropped)."""
    order, bounds, offset = [], [0], 0
    for t, h, w in grids.tolist():
        h, w = h // merge, w // merge
        index = np.arange(t * h * w).reshape(t, h, w)
        pad_h, pad_w = window - h % window, window - w % window
        across, down = (w + pad_w) // window, (h + pad_h) // window
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        padded = padded.reshape(t, down, window, across, window).transpose(0, 1, 3, 2, 4)
        padded = padded.reshape(t, down * across, window, window)
        sizes = (padded != -100).sum(axis=(2, 3)).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + offset)
        bounds.extend((np.cumsum(sizes) * unit + bounds[-1]).tolist())
        offset += t * h * w
    return np.concatenate(order), np.unique(np.array(bounds, np.int32))


class HostIndexedTower:
    """Mixed into the tower's own class (``install``): its ``__call__`` with the index
    arithmetic on the host; the layers, the patch embedding and the merger its own."""

    def __call__(self, hidden_states: mx.array, grid_thw: mx.array,
                 output_hidden_states: Optional[bool] = None) -> mx.array:
        grids = np.asarray(grid_thw).astype(np.int64)
        hidden_states = self.patch_embed(hidden_states)
        positions = rotary_positions(grids, self.spatial_merge_size)
        # The rotary table's length as a NumPy integer: it takes ``.item()`` of it.
        table = self.rotary_pos_emb(np.int64(grids[:, 1:].max()))
        rotary = table[mx.array(positions)].reshape(positions.shape[0], -1)
        bounds = sequence_bounds(grids)
        full = getattr(self, "fullatt_block_indexes", None)
        if full is None:  # Qwen2-VL: every layer attends within each image
            for block in self.blocks:
                hidden_states = block(hidden_states, cu_seqlens=bounds, rotary_pos_emb=rotary)
            return self.merger(hidden_states)
        unit = self.spatial_merge_unit
        order, window_bounds = windows(grids, self.window_size // self.spatial_merge_size // self.patch_size,
                                       self.spatial_merge_size, unit)
        by_window = mx.array(order)
        length = hidden_states.shape[0]
        hidden_states = hidden_states.reshape(length // unit, unit, -1)[by_window].reshape(length, -1)
        rotary = rotary.reshape(length // unit, unit, -1)[by_window].reshape(length, -1)
        for number, block in enumerate(self.blocks):
            hidden_states = block(hidden_states, cu_seqlens=bounds if number in full else window_bounds,
                                  rotary_pos_emb=rotary)
        hidden_states = self.merger(hidden_states)
        return hidden_states[mx.array(np.argsort(order)), :]


# The towers this arithmetic is theirs of (Qwen3-VL's, and others, are not).
TOWERS = ("mlx_vlm.models.qwen2_vl.vision", "mlx_vlm.models.qwen2_5_vl.vision")


def install(tower) -> bool:
    """Give ``tower``, where it is a Qwen2-VL or Qwen2.5-VL ``VisionModel``, the host's
    index arithmetic, on this instance; returns whether it has it. Its attention reads
    the bounds it is given with ``[1:-1].tolist()``, which a NumPy array answers on the
    host."""
    return mix_in(tower, HostIndexedTower, TOWERS)
