"""``x @ W.T`` on CUDA with each row's bits independent of the other rows.

MLX's CUDA matmul picks its kernel by the number of rows: a gemv for one row, cuBLAS's
choice of algorithm for more. Those add a dot product's terms in different orders, so a
row multiplied in a batch of eight gets other bits than alone (``bench/
batch_invariance.py``, H200: every projection of a Gemma-3-4B layer, at 2 rows and
up), and a batched request drifts from the tokens it gets alone.

This kernel adds every dot product's terms in one fixed order whatever the row count:

- one block per 32 output columns and per 128 rows (32 up to 64 rows), with four
  warps (eight where the input dimension is 4,096 or more);
- the input dimension in chunks of 64: warp ``w`` of ``W`` takes chunks ``w, w + W,
  ...`` in ascending order, each as four tensor-core multiply-adds (bfloat16 or float16
  in, float32 sums). Lane ``t`` of a quad reads 16 consecutive elements of its row and
  of the weight's row (16-byte loads; 4/8-bit weights are unpacked in registers) and
  feeds them to the four instructions in a fixed arrangement, the same for both
  operands. The next chunk's weights (and in blocks of up to 32 rows, its rows) load
  while the tensor cores take this one's. Any remainder of the input dimension runs in
  steps of 16 on warp 0;
- the warps' sums meet in a fixed tree, then the bias is added and the sum rounded.

A row's sums never meet another row's, and the blocks, chunks and warps a row passes
through depend only on the shapes of the weight: a row batched and alone get the same
bits (``tests/test_cuda_matmul.py``, on a CUDA machine). float32 takes a plain kernel,
one thread per output, the terms in input order.

Without a GPU, ``tests/test_cuda_emulated.py`` runs these kernels' source on a CPU
emulation of CUDA: which operands meet in which order, every variant against the default.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from ..mlx_runtime import cuda_available as available  # where this kernel runs

# Warps per block, each taking every WARPS-th chunk of the input dimension: more where
# the input dimension is long (an MLP's down projection), so that its few blocks keep
# enough loads in flight. It follows from the weight's shape alone.
LONG_INPUT = 4096


def warps_for(width: int) -> int:
    return 8 if width >= LONG_INPUT else 4


ROW_TILES = (1, 2, 4, 8)  # tiles of 16 rows a block may take: up to 128 rows

# Up to this many rows (a decode step's batch), blocks take at most two tiles, so that
# they load rows ahead (``PREFETCH_ROWS_MAX_TILES``) and more of them keep loads in
# flight. H200, Gemma-3-4B-shaped decode step: 12.2 against 13.1 ms at 64 rows; at 128
# rows blocks of 32 lose (20.5 against 18.0 ms), so larger counts keep larger blocks.
SMALL_BLOCK_ROWS = 64


def layout(rows: int, width: int) -> tuple[int, int, int]:
    """(tiles of 16 rows, tiles of 8 output columns, warps) per block for ``rows`` rows
    of ``width`` inputs. Only the warps change a row's bits, and they follow the
    weight's shape alone; the tiles spread the work over the card."""
    tiles = next((t for t in ROW_TILES if rows <= t * 16), ROW_TILES[-1])
    if rows <= SMALL_BLOCK_ROWS:
        tiles = min(tiles, 2)
    return tiles, 4, warps_for(width)


# One m16n8k16 tensor-core multiply-add into float32 sums; the last argument picks the
# input type. (Also the engine's tensor-core attention: ``decode/cuda_attention.py``.)
MMA = """
// One m16n8k16 tensor-core multiply-add into float32 sums; the last argument picks the
// input type.
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1, __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1, __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
"""

_HEADER = MMA + """
// Two elements of a row as one register: zeros past the end of the row or the matrix.
template <typename T>
__device__ __forceinline__ unsigned pair(const T* row, int k, int K, bool valid) {
  T v[2];
  v[0] = (valid && k < K) ? row[k] : T(0.0f);
  v[1] = (valid && k + 1 < K) ? row[k + 1] : T(0.0f);
  return *reinterpret_cast<unsigned*>(v);
}
"""

# Lane (g, t) = (lane / 4, lane % 4). An m16n8k16 instruction takes from lane (g, t)
# rows g and g + 8 of the 16-row tile and column g of the 8-column tile, at the
# instruction's k positions {2t, 2t+1} (register 0 of A and B, register 1 of A) and
# {2t+8, 2t+9} (register 2 of A, register 1 of B). In a 64-wide chunk, lane t loads the
# elements 16t .. 16t+15 of each row, and instruction j takes elements 16t+4j .. +1 as
# the first pair and 16t+4j+2 .. +3 as the second: every element of the chunk meets its
# partner exactly once, in the same place for every row.
_SOURCE = """
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int M = x_shape[0];
  const int n0 = (ROWS_FIRST ? blockIdx.y : blockIdx.x) * (FT * 8);
  const int m0 = (ROWS_FIRST ? blockIdx.x : blockIdx.y) * (TILES * 16);
  float acc[TILES][FT][4];
  for (int i = 0; i < TILES; ++i)
    for (int f = 0; f < FT; ++f)
      for (int e = 0; e < 4; ++e) acc[i][f][e] = 0.0f;

  constexpr int CHUNKS = (K % 8) == 0 ? K / 64 : 0;  // 16-byte loads need rows of 8
  // The weights of chunk c for this lane, into b: the next chunk's loads are in flight
  // while the tensor cores take this one's.
  auto load_weights = [&](unsigned (*b)[8], int c) {
    const int k = c * 64 + 16 * t;
    for (int f = 0; f < FT; ++f) {
      const int n = n0 + f * 8 + g;
      if (n < N) {
        LOAD_WEIGHTS
      } else {
        for (int e = 0; e < 8; ++e) b[f][e] = 0u;
      }
    }
  };
  // Rows r0 and r0 + 8 of each tile at chunk c for this lane, into a (zeros past M).
  auto load_rows = [&](unsigned (*a)[2][8], int c) {
    const int k = c * 64 + 16 * t;
    for (int i = 0; i < TILES; ++i) {
      for (int h = 0; h < 2; ++h) {
        const int r = m0 + i * 16 + g + 8 * h;
        if (r < M) {
          const uint4* p = reinterpret_cast<const uint4*>(x + (size_t)r * K + k);
          *reinterpret_cast<uint4*>(&a[i][h][0]) = p[0];
          *reinterpret_cast<uint4*>(&a[i][h][4]) = p[1];
        } else {
          for (int e = 0; e < 8; ++e) a[i][h][e] = 0u;
        }
      }
    }
  };
  // Where PREFETCH_ROWS, the next chunk's rows are in flight with its weights (registers
  // for a few tiles); else each chunk's rows load just before its multiply-adds. The
  // same operands in the same order either way.
  unsigned b[FT][8], next[FT][8];
  unsigned rows[TILES][2][8], next_rows[PREFETCH_ROWS ? TILES : 1][2][8];
  if (warp < CHUNKS) {
    load_weights(b, warp);
    if constexpr (PREFETCH_ROWS) load_rows(rows, warp);
  }
  for (int c = warp; c < CHUNKS; c += WARPS) {
    if (c + WARPS < CHUNKS) {
      load_weights(next, c + WARPS);
      if constexpr (PREFETCH_ROWS) load_rows(next_rows, c + WARPS);
    }
    if constexpr (!PREFETCH_ROWS) load_rows(rows, c);
    for (int i = 0; i < TILES; ++i) {
      for (int j = 0; j < 4; ++j) {
        const unsigned a[4] = {rows[i][0][2 * j], rows[i][1][2 * j], rows[i][0][2 * j + 1],
                               rows[i][1][2 * j + 1]};
        for (int f = 0; f < FT; ++f) mma16816(acc[i][f], a, b[f][2 * j], b[f][2 * j + 1], T());
      }
    }
    for (int f = 0; f < FT; ++f)
      for (int e = 0; e < 8; ++e) b[f][e] = next[f][e];
    if constexpr (PREFETCH_ROWS) {
      for (int i = 0; i < TILES; ++i)
        for (int h = 0; h < 2; ++h)
          for (int e = 0; e < 8; ++e) rows[i][h][e] = next_rows[i][h][e];
    }
  }
  TAIL
  // The warps' sums meet in halves, a tile at a time, in a fixed order: with four
  // warps, (0 + 2) + (1 + 3).
  __shared__ float partial[WARPS / 2][FT][4][32];
  for (int i = 0; i < TILES; ++i) {
    for (int half = WARPS / 2; half >= 1; half /= 2) {
      if (warp >= half && warp < 2 * half) {
        for (int f = 0; f < FT; ++f)
          for (int e = 0; e < 4; ++e) partial[warp - half][f][e][lane] = acc[i][f][e];
      }
      __syncthreads();
      if (warp < half) {
        for (int f = 0; f < FT; ++f)
          for (int e = 0; e < 4; ++e) acc[i][f][e] += partial[warp][f][e][lane];
      }
      __syncthreads();
    }
  }
  if (warp != 0) return;
  for (int i = 0; i < TILES; ++i) {
    for (int f = 0; f < FT; ++f) {
      const int n = n0 + f * 8 + 2 * t;
      for (int e = 0; e < 4; ++e) {
        float s = acc[i][f][e];
        const int r = m0 + i * 16 + g + (e / 2) * 8, col = n + e % 2;
        if (r < M && col < N) {
          BIAS
          y[(size_t)r * N + col] = static_cast<T>(s);
        }
      }
    }
  }
"""

# The rest of a plain weight's input dimension (quantized weights have none).
_TAIL = """
  // The rest of the input dimension, in the instruction's own arrangement, on warp 0.
  if (warp == 0) {
    for (int k = CHUNKS * 64; k < K; k += 16) {
      unsigned b[FT][2];
      for (int f = 0; f < FT; ++f) {
        const int n = n0 + f * 8 + g;
        const T* row = w + (size_t)n * K;
        b[f][0] = pair<T>(row, k + 2 * t, K, n < N);
        b[f][1] = pair<T>(row, k + 2 * t + 8, K, n < N);
      }
      for (int i = 0; i < TILES; ++i) {
        const int r0 = m0 + i * 16 + g, r1 = r0 + 8;
        const T* x0 = x + (size_t)r0 * K;
        const T* x1 = x + (size_t)r1 * K;
        const unsigned a[4] = {pair<T>(x0, k + 2 * t, K, r0 < M), pair<T>(x1, k + 2 * t, K, r1 < M),
                               pair<T>(x0, k + 2 * t + 8, K, r0 < M), pair<T>(x1, k + 2 * t + 8, K, r1 < M)};
        for (int f = 0; f < FT; ++f) mma16816(acc[i][f], a, b[f][0], b[f][1], T());
      }
    }
  }

"""

# float32: one thread per output, its terms in input order.
_SOURCE_F32 = """
  const int M = x_shape[0];
  const int col = blockIdx.x * blockDim.x + threadIdx.x;
  const int r = blockIdx.y;
  if (col >= N || r >= M) return;
  const float* xr = x + (size_t)r * K;
  const float* wr = w + (size_t)col * K;
  float s = 0.0f;
  for (int k = 0; k < K; ++k) s = fmaf(xr[k], wr[k], s);
  BIAS
  y[(size_t)r * N + col] = s;
"""


# How a block's lanes load 16 weights of a row (``w`` row ``n``, from element ``k``)
# into ``b[f]``: plain, two 16-byte loads; quantized (MLX's affine format, ``BITS`` per
# weight, low bits first, a scale and a bias per ``GROUP`` weights), one load of the
# packed words, each weight then ``code * scale + bias`` in float32, rounded to T.
_LOAD_PLAIN = """
        const uint4* p = reinterpret_cast<const uint4*>(w + (size_t)n * K + k);
        *reinterpret_cast<uint4*>(&b[f][0]) = p[0];
        *reinterpret_cast<uint4*>(&b[f][4]) = p[1];
"""
_LOAD_QUANTIZED = """
        const uint32_t* packed = w + (size_t)n * (K * BITS / 32) + k * BITS / 32;
        unsigned q[BITS / 2];
        if constexpr (BITS == 4) {
          *reinterpret_cast<uint2*>(q) = *reinterpret_cast<const uint2*>(packed);
        } else {
          *reinterpret_cast<uint4*>(q) = *reinterpret_cast<const uint4*>(packed);
        }
        const size_t at = (size_t)n * (K / GROUP) + k / GROUP;
        const float scale = static_cast<float>(scales[at]), shift = static_cast<float>(biases[at]);
        T v[16];
        for (int e = 0; e < 16; ++e) {
          const unsigned code = (q[e * BITS / 32] >> ((e * BITS) % 32)) & ((1u << BITS) - 1u);
          v[e] = static_cast<T>(fmaf(static_cast<float>(code), scale, shift));
        }
        for (int e = 0; e < 8; ++e) b[f][e] = *reinterpret_cast<unsigned*>(&v[2 * e]);
"""


def quantized(module) -> bool:
    return "scales" in module


def own_bias(module: nn.Module) -> mx.array | None:
    """The bias a layer adds to its own product, if any (a row-sharded layer adds its
    after the group's sum)."""
    return module.get("bias") if isinstance(module, (nn.Linear, nn.QuantizedLinear)) else None


def weight_dtype(module: nn.Module) -> mx.Dtype:
    """The dtype a layer multiplies in: its weight's, or a quantized layer's scales'."""
    return module.scales.dtype if quantized(module) else module.weight.dtype


def in_weight_dtype(product, x: mx.array, module: nn.Module) -> mx.array:
    """``product(x, module)`` with ``x`` rounded to the layer's dtype (a product of one
    dtype), the result given in the dtype MLX's matmul would give."""
    dtype = weight_dtype(module)
    if x.dtype == dtype:
        return product(x, module)
    promoted = (mx.zeros((0,), x.dtype) + mx.zeros((0,), dtype)).dtype  # MLX's rule
    return product(x.astype(dtype), module).astype(promoted)


def fits(module: nn.Module, dtype: mx.Dtype) -> bool:
    """Whether ``linear(x, module)`` runs as the kernel for inputs of ``dtype``: on
    CUDA, for a linear layer or embedding table (as the output layer) whose weights
    are plain, of ``dtype``, or quantized in MLX's affine format (4 or 8 bits, groups
    of 32 to 128, with bfloat16 or float16 inputs)."""
    if not available() or "weight" not in module:
        return False
    if not quantized(module):
        return (module.weight.ndim == 2 and module.weight.dtype == dtype
                and dtype in (mx.bfloat16, mx.float16, mx.float32))
    k = module.scales.shape[-1] * module.group_size
    return (getattr(module, "mode", "affine") == "affine" and module.bits in (4, 8)
            and module.group_size in (32, 64, 128) and k % 64 == 0
            and module.get("biases") is not None and module.scales.dtype == dtype
            and dtype in (mx.bfloat16, mx.float16))


# Whether the blocks of one column tile's row blocks come one after another (the grid's
# first axis runs over row blocks). The card starts blocks in grid order: with column
# blocks first, a weight larger than L2 (gate/up, down, the output layer) is likely read
# from memory once per row block. On an H200 (bf16, Gemma-3-4B shape) row blocks first
# took the output layer at 64 rows from 0.84 to 0.72 ms, gate/up from 0.10 to 0.09 ms at
# 64 rows and from 0.77 to 0.59 at 1,024, and the B=64 decode step from 12.4 to 11.1 ms;
# elsewhere it was level within the run's noise (4-bit weights, which fit in L2, either
# way by up to 15%). The blocks compute the same either way (the same bits).
ROW_BLOCKS_FIRST = True

# Blocks of at most this many tiles of 16 rows load the next chunk's rows with its weights,
# ahead of this chunk's multiply-adds: the same operands in the same order, so the same
# bits (``tests/test_cuda_matmul.py``). Registers a thread (nvcc for sm_90, bf16):
# 126 / 174 at one / two tiles against 112 / 130 without; four tiles would spill.
PREFETCH_ROWS_MAX_TILES = 2

@functools.cache
def _kernel(has_bias: bool, kind: str):
    """``kind``: "f32" (plain float32), "plain" or "quantized" (tensor cores)."""
    inputs = ["x", "w"] + (["scales", "biases"] if kind == "quantized" else [])
    inputs += ["bias"] if has_bias else []
    source = _SOURCE_F32
    if kind != "f32":
        quantized = kind == "quantized"
        source = _SOURCE.replace("LOAD_WEIGHTS", _LOAD_QUANTIZED if quantized else _LOAD_PLAIN)
        source = source.replace("TAIL", "" if quantized else _TAIL)
    return mx.fast.cuda_kernel(
        name=f"vlm_matmul_{kind}{'_bias' if has_bias else ''}",
        input_names=inputs,
        output_names=["y"],
        source=source.replace("BIAS", "s += static_cast<float>(bias[col]);" if has_bias else ""),
        header="" if kind == "f32" else _HEADER,
    )


def linear(x: mx.array, module: nn.Module) -> mx.array:
    """``module(x)`` for a linear layer (an embedding table: ``module.as_linear(x)``),
    each row's bits independent of the other rows (where ``fits``). Inputs of another
    dtype than the layer's are rounded to it (the kernel multiplies one dtype), and the
    result is given in the dtype MLX's matmul would give."""
    if x.dtype != weight_dtype(module):
        return in_weight_dtype(linear, x, module)
    *lead, width = x.shape
    rows = x.reshape(-1, width)
    m = rows.shape[0]
    n = module.weight.shape[0]
    inputs = [rows, module.weight]
    template = [("K", width), ("N", n)]
    if quantized(module):
        inputs += [module.scales, module.biases]
        template += [("BITS", module.bits), ("GROUP", module.group_size)]
    bias = own_bias(module)
    if bias is not None:
        inputs.append(bias.astype(x.dtype))
    common = dict(inputs=inputs, output_shapes=[(m, n)], output_dtypes=[x.dtype])
    if x.dtype == mx.float32:
        threads = 128
        out = _kernel(bias is not None, "f32")(
            **common, template=template,
            grid=(-(-n // threads) * threads, max(m, 1), 1), threadgroup=(threads, 1, 1),
        )[0]
    else:
        tiles, column_tiles, warps = layout(m, width)
        row_blocks, column_blocks = max(1, -(-m // (tiles * 16))), -(-n // (8 * column_tiles))
        blocks = (row_blocks, column_blocks) if ROW_BLOCKS_FIRST else (column_blocks, row_blocks)
        out = _kernel(bias is not None, "quantized" if quantized(module) else "plain")(
            **common,
            template=[("T", x.dtype), *template, ("TILES", tiles), ("FT", column_tiles),
                      ("WARPS", warps), ("PREFETCH_ROWS", tiles <= PREFETCH_ROWS_MAX_TILES),
                      ("ROWS_FIRST", ROW_BLOCKS_FIRST)],
            grid=(blocks[0] * warps * 32, blocks[1], 1),
            threadgroup=(warps * 32, 1, 1),
        )[0]
    return out.reshape(*lead, n)
