"""A decode step's query, key and value heads as one CUDA kernel (MLX's ops elsewhere).

Gemma 3 takes its heads from the fused query/key/value projection (``fused.py``): it
RMS-normalizes each query and key head, rotates both by the row's position, and keeps
the value heads as they are. With MLX's ops that is six kernels a layer, the two norms
each preceded by a copy (their input is a column slice, and MLX's RMSNorm wants rows
with no gaps). On CUDA a decode step's cost is mostly the host launching its kernels one
by one, so here it is one kernel: 34 layers of Gemma 3 4B, 170 launches fewer a step.

One block per (row, head), its threads each taking one pair of rotated elements: a
head's sum of squares is added in the same order whatever else is in the batch, so a
row gets the same bits batched as alone (``tests/test_cuda_heads.py``, on a CUDA
machine; ``tests/test_cuda_emulated.py`` on the CPU). The arithmetic is MLX's: the norm
in float32, rounded to the input's dtype before the weight multiplies it, as MLX's
RMSNorm does; then MLX's rotary angles and rotation in float32.
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn

from ...mlx_runtime import kernel_constant
from .cuda_attention import available
from .cuda_norms import BLOCK_SUM

_SOURCE = """
  const int head = blockIdx.x, row = blockIdx.y, i = threadIdx.x;
  const size_t in = ((size_t)row * (H + 2 * KV) + head) * D;
  const bool mine = i < HALF;
  if (head >= H + KV) {  // a value head: as it is
    const size_t out = ((size_t)row * KV + head - H - KV) * D;
    if (mine) {
      v[out + i] = qkv[in + i];
      v[out + i + HALF] = qkv[in + i + HALF];
    }
    return;  // the whole block: it is one head
  }
  const float x1 = mine ? static_cast<float>(qkv[in + i]) : 0.0f;
  const float x2 = mine ? static_cast<float>(qkv[in + i + HALF]) : 0.0f;
  __shared__ float sums[THREADS / 32];
  const float inv = rsqrtf(block_sum<THREADS>(x1 * x1 + x2 * x2, sums) / D + EPS);
  if (!mine) return;
  const bool query = head < H;
  const T* w = query ? q_norm : k_norm;
  const float n1 = static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(x1 * inv));
  const float n2 = static_cast<float>(w[i + HALF]) * static_cast<float>(static_cast<T>(x2 * inv));
  const float a = static_cast<float>(static_cast<T>(n1)), b = static_cast<float>(static_cast<T>(n2));
  const float inv_freq = exp2f(-(static_cast<float>(i) / static_cast<float>(HALF)) * LOG2_BASE);
  const float theta = (ROPE_SCALE * static_cast<float>(positions[row])) * inv_freq;
  const float c = cosf(theta), s = sinf(theta);
  T* out = query ? q + ((size_t)row * H + head) * D : k + ((size_t)row * KV + head - H) * D;
  out[i] = static_cast<T>(a * c - b * s);
  out[i + HALF] = static_cast<T>(a * s + b * c);
"""


def fits(rope, head_dim: int, dtype) -> bool:
    """Whether ``DecodeHeads`` runs as the kernel: on CUDA, for MLX's plain RoPE over
    whole heads (not the traditional pairing) and the dtypes the kernel is built for."""
    return (available() and dtype in (mx.bfloat16, mx.float32) and type(rope) is nn.RoPE
            and rope.dims == head_dim and not rope.traditional and head_dim % 2 == 0
            and head_dim // 2 <= 1024)


class DecodeHeads:
    """``(qkv, positions) -> (q, k, v)``: from the fused projection's output (rows,
    (heads + 2 * kv_heads) * head_dim), the query heads (rows, heads, 1, head_dim) and
    key heads RMS-normalized by ``q_norm`` / ``k_norm`` (full weights) and rotated by
    ``rope`` at each row's position in ``positions`` (rows,); the value heads as they
    are. One kernel where it ``fits``, else MLX's ops."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, q_norm: mx.array, k_norm: mx.array,
                 eps: float, rope):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_norm, self.k_norm, self.eps, self.rope = q_norm, k_norm, eps, rope
        self.split = [heads * head_dim, (heads + kv_heads) * head_dim]

    def __call__(self, qkv: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if fits(self.rope, self.head_dim, qkv.dtype):
            return self.fused(qkv, positions)
        B = qkv.shape[0]
        q, k, v = mx.split(qkv, self.split, axis=-1)
        # One token per row: (B, heads * dim) is (B, heads, 1, dim) without a transpose.
        q = mx.fast.rms_norm(q.reshape(B, self.heads, 1, -1), self.q_norm, self.eps)
        k = mx.fast.rms_norm(k.reshape(B, self.kv_heads, 1, -1), self.k_norm, self.eps)
        return (self.rope(q, offset=positions), self.rope(k, offset=positions),
                v.reshape(B, self.kv_heads, 1, -1))

    def fused(self, qkv: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """``__call__`` as the kernel (CUDA only)."""
        rows, D = qkv.shape[0], self.head_dim
        threads = -(-(D // 2) // 32) * 32
        shapes = [(rows, n, 1, D) for n in (self.heads, self.kv_heads, self.kv_heads)]
        return tuple(_kernel(self.eps, math.log2(self.rope.base), self.rope.scale)(
            inputs=[qkv, self.q_norm, self.k_norm, positions],
            template=[("T", qkv.dtype), ("H", self.heads), ("KV", self.kv_heads), ("D", D),
                      ("HALF", D // 2), ("THREADS", threads)],
            grid=(threads * (self.heads + 2 * self.kv_heads), rows, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=shapes,
            output_dtypes=[qkv.dtype] * 3,
        ))


@functools.cache
def _kernel(eps: float, log2_base: float, scale: float):
    constants = [kernel_constant(name, value) for name, value in
                 (("EPS", eps), ("LOG2_BASE", log2_base), ("ROPE_SCALE", scale))]
    return mx.fast.cuda_kernel(
        name="vlm_decode_heads_" + "_".join(tag for _, tag in constants),
        input_names=["qkv", "q_norm", "k_norm", "positions"],
        output_names=["q", "k", "v"],
        source=_SOURCE,
        header=BLOCK_SUM + "".join(define for define, _ in constants),
    )
