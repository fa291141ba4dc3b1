"""A layer's query, key and value heads as one CUDA kernel, in decode steps and prefill
passes (MLX's ops elsewhere).

Gemma 3 takes its heads from the fused query/key/value projection (``fused.py``): it
RMS-normalizes each query and key head, rotates both by the token's position, and keeps
the value heads as they are. With MLX's ops that is six kernels a layer, the two norms
each preceded by a copy (their input is a column slice, or a pass's transposed view, and
MLX's RMSNorm wants rows with no gaps). On CUDA the host launching kernels one by one is
most of a decode step's cost and much of a pass's, so here it is one kernel: 34 layers
of Gemma 3 4B, 170 launches fewer a step or a pass. It writes the heads as attention and
the caches take them: (rows, heads, tokens, head_dim).

One block per (token, head), its threads each taking one pair of rotated elements: a
head's sum of squares is added in the same order whatever else is in the batch or the
pass, so a token's heads get the same bits batched as alone
(``tests/test_cuda_heads.py``, on a CUDA machine; ``tests/test_cuda_emulated.py`` on the
CPU). The arithmetic is MLX's: the norm in float32, rounded to the input's dtype before
the weight multiplies it, as MLX's RMSNorm does; then MLX's rotary angles and rotation
in float32.
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
  // Block (token, head); token = b * L + l: row b's l-th token of the pass.
  const int token = blockIdx.x, head = blockIdx.y, i = threadIdx.x;
  const int L = qkv_shape[0] / starts_shape[0];
  const int b = token / L, l = token % L;
  const size_t in = ((size_t)token * (H + 2 * KV) + head) * D;
  const bool mine = i < HALF;
  if (head >= H + KV) {  // a value head: as it is
    const size_t out = (((size_t)b * KV + head - H - KV) * L + l) * D;
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
  const float y1 = static_cast<float>(static_cast<T>(n1)), y2 = static_cast<float>(static_cast<T>(n2));
  const float inv_freq = exp2f(-(static_cast<float>(i) / static_cast<float>(HALF)) * LOG2_BASE);
  const float theta = (ROPE_SCALE * static_cast<float>(starts[b] + l)) * inv_freq;
  const float c = cosf(theta), s = sinf(theta);
  T* out = query ? q + (((size_t)b * H + head) * L + l) * D : k + (((size_t)b * KV + head - H) * L + l) * D;
  out[i] = static_cast<T>(y1 * c - y2 * s);
  out[i + HALF] = static_cast<T>(y1 * s + y2 * c);
"""


def fits(rope, head_dim: int, dtype) -> bool:
    """Whether ``AttentionHeads`` runs as the kernel: on CUDA, for MLX's plain RoPE over
    whole heads (not the traditional pairing) and the dtypes the kernel is built for."""
    return (available() and dtype in (mx.bfloat16, mx.float32) and type(rope) is nn.RoPE
            and rope.dims == head_dim and not rope.traditional and head_dim % 2 == 0
            and head_dim // 2 <= 1024)


class AttentionHeads:
    """A layer's query, key and value heads from its fused projection's output (tokens,
    (heads + 2 * kv_heads) * head_dim): the query and key heads RMS-normalized by
    ``q_norm`` / ``k_norm`` (full weights) and rotated by ``rope``, the value heads as
    they are. A decode step's (``__call__``) and, where the kernel ``fits``, a prefill
    pass's (``fused`` with ``length``)."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, q_norm: mx.array, k_norm: mx.array,
                 eps: float, rope):
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_norm, self.k_norm, self.eps, self.rope = q_norm, k_norm, eps, rope
        self.split = [heads * head_dim, (heads + kv_heads) * head_dim]

    def fits(self, dtype) -> bool:
        # The kernel reads the norms' weights as the heads' type.
        return fits(self.rope, self.head_dim, dtype) and self.q_norm.dtype == self.k_norm.dtype == dtype

    def __call__(self, qkv: mx.array, positions: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """A decode step's heads, (rows, heads, 1, head_dim) each, at each row's position
        in ``positions`` (rows,): the kernel where it ``fits``, else MLX's ops."""
        if self.fits(qkv.dtype):
            return self.fused(qkv, positions)
        B = qkv.shape[0]
        q, k, v = mx.split(qkv, self.split, axis=-1)
        # One token per row: (B, heads * dim) is (B, heads, 1, dim) without a transpose.
        q = mx.fast.rms_norm(q.reshape(B, self.heads, 1, -1), self.q_norm, self.eps)
        k = mx.fast.rms_norm(k.reshape(B, self.kv_heads, 1, -1), self.k_norm, self.eps)
        return (self.rope(q, offset=positions), self.rope(k, offset=positions),
                v.reshape(B, self.kv_heads, 1, -1))

    def fused(self, qkv: mx.array, starts: mx.array, length: int = 1) -> tuple[mx.array, mx.array, mx.array]:
        """The kernel (CUDA only) over ``length`` tokens a row: ``qkv`` holds row ``b``'s
        tokens at ``b * length ...``, at positions ``starts[b]`` (int32, (rows,)) on.
        Returns (rows, heads, length, head_dim) each."""
        tokens, D = qkv.shape[0], self.head_dim
        rows = tokens // length
        threads = -(-(D // 2) // 32) * 32
        shapes = [(rows, n, length, D) for n in (self.heads, self.kv_heads, self.kv_heads)]
        return tuple(_kernel(self.eps, math.log2(self.rope.base), self.rope.scale)(
            inputs=[qkv, self.q_norm, self.k_norm, starts],
            template=[("T", qkv.dtype), ("H", self.heads), ("KV", self.kv_heads), ("D", D),
                      ("HALF", D // 2), ("THREADS", threads)],
            grid=(threads * tokens, self.heads + 2 * self.kv_heads, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=shapes,
            output_dtypes=[qkv.dtype] * 3,
        ))


@functools.cache
def _kernel(eps: float, log2_base: float, scale: float):
    constants = [kernel_constant(name, value) for name, value in
                 (("EPS", eps), ("LOG2_BASE", log2_base), ("ROPE_SCALE", scale))]
    return mx.fast.cuda_kernel(
        name="vlm_attention_heads_" + "_".join(tag for _, tag in constants),
        input_names=["qkv", "q_norm", "k_norm", "starts"],
        output_names=["q", "k", "v"],
        source=_SOURCE,
        header=BLOCK_SUM + "".join(define for define, _ in constants),
    )
