"""A residual add between two RMSNorms as one CUDA kernel, for decode steps and prefill
passes (MLX's ops elsewhere).

Gemma's layers end both halves the same way: ``h = x + rms_norm(r, w_after)``, then
``rms_norm(h, w_next)`` for what comes next (the MLP's input, or the next layer's). MLX
runs that as three kernels, and on CUDA a decode step's cost is mostly the host
launching its kernels one by one (``bench/results/gpu-h100-prefill-wait``), as is much
of a prefill pass's: one kernel instead of three is two launches fewer, twice per layer.

One block per row (a step's row or a pass's token), with a fixed number of threads: a
row's sums of squares are added in the same order whatever else is in the batch or the
pass, so a row batched and alone get the same bits (``tests/test_cuda_norms.py``, on a
CUDA machine; ``tests/test_cuda_emulated.py`` on the CPU). The arithmetic is close to
MLX's: the norms in float32, ``h`` and each norm rounded to the input's dtype (MLX also
rounds a norm before its weight multiplies it).
"""

from __future__ import annotations

import functools
import os

import mlx.core as mx

from ...mlx_runtime import kernel_constant
from .cuda_attention import available

THREADS = 256

# A block's sum of one float a thread, in the same order whatever the launch (a
# device function, for the kernels' headers: this one's and ``cuda_heads``').
BLOCK_SUM = """
template <int THREADS>
__device__ __forceinline__ float block_sum(float x, float* shared) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = x;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < THREADS / 32; ++w) total += shared[w];  // in warp order, on every thread
  __syncthreads();  // the shared slots are free again
  return total;
}
"""

# The kernel's body in one of two forms with the same sums in the same order, so the
# same bits (``tests/test_cuda_emulated.py``): ``passes`` reads a thread's elements of
# the row (t, t + THREADS, ...) again in each of its three passes; ``registers`` keeps
# them in registers from the first pass to the last, one trip to memory instead of
# three (a decode step's 64 rows are too few blocks to hide them), for more registers
# a thread (nvcc for sm_90: 64 at Gemma-3-4B's 2,560, 128 at 5,376). ``registers`` by
# default: on an H200 at 2,560 its 136 launches take 0.94 ms of a 64-row decode step
# against 1.58, and 2.42 ms of a 4-prompt prefill pass against 3.08
# (bench/results/gpu-h200-norms-registers). ``VLM_SERVE_ADD_NORM=passes`` picks the
# other, which holds more blocks an SM where rows are wide.
FORMS = ("passes", "registers")
FORM = os.environ.get("VLM_SERVE_ADD_NORM", "registers")

_PASSES = """
  const size_t base = (size_t)blockIdx.x * H;  // one block a row: x takes a prefill pass's rows
  __shared__ float sums[THREADS / 32];
  float ss = 0.0f;
  for (int i = threadIdx.x; i < H; i += THREADS) {
    const float v = static_cast<float>(r[base + i]);
    ss += v * v;
  }
  const float inv_r = rsqrtf(block_sum<THREADS>(ss, sums) / H + EPS);
  ss = 0.0f;
  for (int i = threadIdx.x; i < H; i += THREADS) {
    const T normed = static_cast<T>(static_cast<float>(r[base + i]) * inv_r * static_cast<float>(w_after[i]));
    const T sum = static_cast<T>(static_cast<float>(x[base + i]) + static_cast<float>(normed));
    h[base + i] = sum;
    const float v = static_cast<float>(sum);
    ss += v * v;
  }
  const float inv_h = rsqrtf(block_sum<THREADS>(ss, sums) / H + EPS);
  for (int i = threadIdx.x; i < H; i += THREADS) {
    n[base + i] = static_cast<T>(static_cast<float>(h[base + i]) * inv_h * static_cast<float>(w_next[i]));
  }
"""

_REGISTERS = """
  constexpr int PER = (H + THREADS - 1) / THREADS;  // a thread's elements of the row
  const size_t base = (size_t)blockIdx.x * H;  // one block a row: x takes a prefill pass's rows
  __shared__ float sums[THREADS / 32];
  T xs[PER], rs[PER], after[PER], next[PER];
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * THREADS;
    if (i < H) {
      xs[k] = x[base + i];
      rs[k] = r[base + i];
      after[k] = w_after[i];
      next[k] = w_next[i];
    }
  }
  float ss = 0.0f;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    if (threadIdx.x + k * THREADS < H) {
      const float v = static_cast<float>(rs[k]);
      ss += v * v;
    }
  }
  const float inv_r = rsqrtf(block_sum<THREADS>(ss, sums) / H + EPS);
  ss = 0.0f;
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * THREADS;
    if (i < H) {
      const T normed = static_cast<T>(static_cast<float>(rs[k]) * inv_r * static_cast<float>(after[k]));
      const T sum = static_cast<T>(static_cast<float>(xs[k]) + static_cast<float>(normed));
      h[base + i] = sum;
      xs[k] = sum;  // h, for the last pass
      const float v = static_cast<float>(sum);
      ss += v * v;
    }
  }
  const float inv_h = rsqrtf(block_sum<THREADS>(ss, sums) / H + EPS);
#pragma unroll
  for (int k = 0; k < PER; ++k) {
    const int i = threadIdx.x + k * THREADS;
    if (i < H) n[base + i] = static_cast<T>(static_cast<float>(xs[k]) * inv_h * static_cast<float>(next[k]));
  }
"""


def fits(x: mx.array) -> bool:
    """Whether ``add_norm`` runs as the kernel for ``x``: on CUDA, for the dtypes in
    which Gemma's residual needs no clipping (float16's does)."""
    return available() and x.dtype in (mx.bfloat16, mx.float32)


def add_norm(x: mx.array, r: mx.array, w_after: mx.array, w_next: mx.array, eps: float,
             clip=None) -> tuple[mx.array, mx.array]:
    """``x``, ``r`` (rows, hidden); ``w_after``, ``w_next`` (hidden,), the norms' full
    weights. Returns ``h = x + rms_norm(r, w_after)`` and ``rms_norm(h, w_next)``: one
    kernel where it ``fits``, else MLX's ops, with ``clip`` (Gemma 3's float16
    clipping) applied to ``h``."""
    if fits(x):
        return fused_add_norm(x, r, w_after, w_next, eps)
    return add_norm_by_ops(x, r, w_after, w_next, eps, clip)


def add_norm_by_ops(x: mx.array, r: mx.array, w_after: mx.array, w_next: mx.array, eps: float,
                    clip=None) -> tuple[mx.array, mx.array]:
    """``add_norm`` as MLX's ops, the model code's."""
    h = x + mx.fast.rms_norm(r, w_after, eps)
    if clip is not None:
        h = clip(h)
    return h, mx.fast.rms_norm(h, w_next, eps)


def source(form: str) -> str:
    """The kernel's body in ``form`` (one of ``FORMS``)."""
    if form not in FORMS:
        raise ValueError(f"VLM_SERVE_ADD_NORM={form!r}: one of {', '.join(FORMS)}")
    return _PASSES if form == "passes" else _REGISTERS


@functools.cache
def _kernel(eps: float, form: str):
    define, tag = kernel_constant("EPS", eps)
    return mx.fast.cuda_kernel(
        name=f"vlm_add_norm_{form}_{tag}",
        input_names=["x", "r", "w_after", "w_next"],
        output_names=["h", "n"],
        source=source(form),
        header=BLOCK_SUM + define,
    )


def fused_add_norm(x: mx.array, r: mx.array, w_after: mx.array, w_next: mx.array,
                   eps: float) -> tuple[mx.array, mx.array]:
    """``add_norm`` as the kernel (CUDA only)."""
    rows, hidden = x.shape
    return _kernel(eps, FORM)(
        inputs=[x, r, w_after, w_next],
        template=[("T", x.dtype), ("H", hidden), ("THREADS", THREADS)],
        grid=(THREADS * rows, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, hidden), (rows, hidden)],
        output_dtypes=[x.dtype, x.dtype],
    )
