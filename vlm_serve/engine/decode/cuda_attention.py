"""Decode attention as two CUDA kernels: one new token per row over the slot store.

MLX's fused single-query kernel takes no mask, so on CUDA a batched decode step (rows of
different lengths) falls back to MLX's composition: a dozen graph nodes per layer, the
keys broadcast to every query head, and the span of the longest row read for every row.
These kernels read each row's own keys only (its count of valid columns), and compute a
row the same way whatever else is in the batch:

- pass 1: one block per (row, query head, chunk of ``CHUNK`` columns); each warp folds
  its fixed run of columns into a running max, sum and weighted values (online softmax,
  float32), and the block combines its warps in order;
- pass 2: one block per (row, query head) combines the chunks in order. Chunks past a
  row's count are empty and add exact zeros, so the number of chunks (which follows the
  store's columns) never changes a row's bits.

The split of columns into chunks and warps depends only on fixed constants and the
row's own count, so a row batched and the same row alone take the same arithmetic.
"""

from __future__ import annotations

import functools

import mlx.core as mx

CHUNK = 256  # columns per block of pass 1
WARPS = 8  # warps per block of pass 1: CHUNK // WARPS columns each
GROUP = 4  # columns a warp loads at once (independent loads in flight)

_HEADER = """
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return __shfl_sync(0xffffffff, x, 0);  // lane 0's order, on every lane
}
"""

_PARTIAL = """
  constexpr int PER_LANE = (D + 31) / 32;
  constexpr int PER_WARP = CHUNK / WARPS;
  const int chunk = blockIdx.x, head = blockIdx.y, row = blockIdx.z;
  const int heads = gridDim.y, chunks = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int columns = keys_shape[2];
  const int kv_head = head / (heads / KV_HEADS);
  const int count = min(counts[row], columns);

  const T* q_row = q + ((size_t)row * heads + head) * D;
  const size_t kv_offset = ((size_t)row * KV_HEADS + kv_head) * columns * D;
  const T* k_row = keys + kv_offset;
  const T* v_row = values + kv_offset;

  float qv[PER_LANE], o[PER_LANE];
  for (int j = 0; j < PER_LANE; ++j) {
    const int d = j * 32 + lane;
    qv[j] = d < D ? static_cast<float>(q_row[d]) : 0.0f;
    o[j] = 0.0f;
  }
  float m = NEG_INF, l = 0.0f;
  const int start = chunk * CHUNK + warp * PER_WARP;
  const int stop = min(start + PER_WARP, count);
  for (int c0 = start; c0 < stop; c0 += GROUP) {
    float s[GROUP];
    for (int g = 0; g < GROUP; ++g) {
      const int c = c0 + g;
      float dot = 0.0f;
      if (c < stop) {
        for (int j = 0; j < PER_LANE; ++j) {
          const int d = j * 32 + lane;
          if (d < D) dot += qv[j] * static_cast<float>(k_row[(size_t)c * D + d]);
        }
      }
      s[g] = dot;
    }
    float m_new = m;
    for (int g = 0; g < GROUP; ++g) {
      s[g] = c0 + g < stop ? warp_sum(s[g]) * SCALE : NEG_INF;
      m_new = fmaxf(m_new, s[g]);
    }
    const float alpha = expf(m - m_new);
    l *= alpha;
    for (int j = 0; j < PER_LANE; ++j) o[j] *= alpha;
    for (int g = 0; g < GROUP; ++g) {
      const int c = c0 + g;
      if (c >= stop) break;
      const float p = expf(s[g] - m_new);
      l += p;
      for (int j = 0; j < PER_LANE; ++j) {
        const int d = j * 32 + lane;
        if (d < D) o[j] += p * static_cast<float>(v_row[(size_t)c * D + d]);
      }
    }
    m = m_new;
  }

  __shared__ float warp_m[WARPS], warp_l[WARPS];
  __shared__ float warp_o[WARPS][D];
  if (lane == 0) { warp_m[warp] = m; warp_l[warp] = l; }
  for (int j = 0; j < PER_LANE; ++j) {
    const int d = j * 32 + lane;
    if (d < D) warp_o[warp][d] = o[j];
  }
  __syncthreads();

  float top = NEG_INF;
  for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[w]);
  float* out = partial + (((size_t)row * heads + head) * chunks + chunk) * (D + 2);
  if (top == NEG_INF) {  // a chunk past the row's count: nothing to add
    for (int d = threadIdx.x; d < D + 2; d += blockDim.x) out[d] = d == D ? NEG_INF : 0.0f;
    return;
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float sum = 0.0f;
    for (int w = 0; w < WARPS; ++w) sum += warp_o[w][d] * expf(warp_m[w] - top);
    out[d] = sum;
  }
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int w = 0; w < WARPS; ++w) sum += warp_l[w] * expf(warp_m[w] - top);
    out[D] = top;
    out[D + 1] = sum;
  }
"""

_COMBINE = """
  const int head = blockIdx.y, row = blockIdx.z;
  const int heads = gridDim.y;
  const int chunks = partial_shape[2];
  const float* parts = partial + ((size_t)row * heads + head) * chunks * (D + 2);
  float top = NEG_INF;
  for (int c = 0; c < chunks; ++c) top = fmaxf(top, parts[c * (D + 2) + D]);
  float sum = 0.0f;
  for (int c = 0; c < chunks; ++c) {
    sum += parts[c * (D + 2) + D + 1] * expf(parts[c * (D + 2) + D] - top);
  }
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.0f;
    for (int c = 0; c < chunks; ++c) {
      acc += parts[c * (D + 2) + d] * expf(parts[c * (D + 2) + D] - top);
    }
    out[((size_t)row * heads + head) * D + d] = static_cast<T>(acc / sum);
  }
"""


def available() -> bool:
    """Whether the default device runs these kernels (MLX's CUDA backend)."""
    cuda = getattr(mx, "cuda", None)  # not every MLX build has the module
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


@functools.cache
def _kernels(scale: float):
    # The scale is a compile-time constant of the kernel (MLX's template arguments
    # take ints, bools and dtypes only).
    header = _HEADER + f"#define SCALE {float(scale)!r}f\n"
    tag = f"{float(scale)!r}".replace(".", "p").replace("-", "m")
    partial = mx.fast.cuda_kernel(
        name=f"vlm_decode_attention_partial_{tag}",
        input_names=["q", "keys", "values", "counts"],
        output_names=["partial"],
        source=_PARTIAL,
        header=header,
    )
    combine = mx.fast.cuda_kernel(
        name=f"vlm_decode_attention_combine_{tag}",
        input_names=["partial"],
        output_names=["out"],
        source=_COMBINE,
        header=header,
    )
    return partial, combine


def decode_attention(
    q: mx.array, keys: mx.array, values: mx.array, counts: mx.array, scale: float
) -> mx.array:
    """``q`` (slots, heads, 1, dim); ``keys``/``values`` the store's (slots, kv_heads,
    columns, dim); ``counts`` (slots,) int32: how many leading columns each row
    attends to. Returns (slots, heads * dim) in ``q``'s dtype."""
    slots, heads, _, dim = q.shape
    kv_heads, columns = keys.shape[1], keys.shape[2]
    chunks = max(1, -(-columns // CHUNK))
    partial_kernel, combine_kernel = _kernels(scale)
    template = [("T", q.dtype), ("D", dim), ("KV_HEADS", kv_heads),
                ("CHUNK", CHUNK), ("WARPS", WARPS), ("GROUP", GROUP)]
    (partial,) = partial_kernel(
        inputs=[q, keys, values, counts],
        template=template,
        grid=(chunks * WARPS * 32, heads, slots),
        threadgroup=(WARPS * 32, 1, 1),
        output_shapes=[(slots, heads, chunks, dim + 2)],
        output_dtypes=[mx.float32],
    )
    (out,) = combine_kernel(
        inputs=[partial],
        template=[("T", q.dtype), ("D", dim)],
        grid=(128, heads, slots),
        threadgroup=(128, 1, 1),
        output_shapes=[(slots, heads * dim)],
        output_dtypes=[q.dtype],
    )
    return out


def reference_attention(
    q: mx.array, keys: mx.array, values: mx.array, counts: mx.array, scale: float
) -> mx.array:
    """What ``decode_attention`` computes, through MLX's own attention with a mask made
    from ``counts`` (to compare with, and to stand in for the kernels where CUDA is not)."""
    slots, heads, _, dim = q.shape
    mask = (mx.arange(keys.shape[2])[None, :] < counts[:, None])[:, None, None, :]
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out.reshape(slots, heads * dim)
