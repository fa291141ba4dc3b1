"""Attention as two CUDA kernels: one new token per row over the slot store (decode),
and the queries of a prefill pass over their prompts' caches.

MLX's fused single-query kernel takes no mask, so on CUDA a batched decode step (rows of
different lengths) falls back to MLX's composition: a dozen graph nodes per layer, the
keys broadcast to every query head, and the span of the longest row read for every row.
These kernels read each row's own keys only (its count of valid columns), and compute a
row the same way whatever else is in the batch:

- pass 1: one block per (row, group of query heads that share a key/value head, chunk
  of ``DECODE_CHUNK`` columns, ``CHUNK`` in a prefill pass), so each key and value is
  loaded once for the group's heads.
  Each warp takes its fixed run of columns in rounds of 32, one column per lane: a
  lane's dot products run over its whole key in dim order (16-byte loads, the queries
  in shared memory), the warp folds the round into a running max, sum and weighted
  values per head (online softmax, float32; each lane keeps a slice of the value
  dims), and the block combines its warps in order. At a batch of 128 rows, pass 1
  with a block per query head and a warp per column was 40% of a Gemma-3-4B step's
  GPU time (ncu); now 34 layers' attention take 0.7x the time of MLX's own
  single-query kernel on rows of one length. Where its sums are few, a lane keeps
  several loads in flight (``loads_in_flight``) and sums them in the same order as one
  at a time: the pass waits on memory's round trips, not its bandwidth. With
  ``PIPELINE`` a decode warp instead copies its keys and values into shared memory
  asynchronously, several pieces ahead of its sums, which run in the same order;
- pass 2: one block per (row, query head) combines the chunks in order. Chunks past a
  row's count are empty and add exact zeros, so the number of chunks (which follows the
  store's columns) never changes a row's bits.

The split of columns into chunks and warps depends only on fixed constants and the
row's own count, and each head's arithmetic is the same whatever heads share its block,
so a row batched and the same row alone take the same arithmetic (``tests/
test_cuda_attention.py``, on a CUDA machine).

A prefill pass (``prefill_attention``) takes each of its queries as a row: the keys of
its prompt, causal and within a window as mlx-lm's masks have them, or as a boolean
mask gives them (Gemma 4's images see each other both ways). For Gemma 3's head size
MLX composes prefill attention on CUDA (about 20 graph nodes a layer); this is 2. A
block of pass 1 may take up to 8 consecutive queries of a prompt (``queries_per_block``):
each key and value a lane loads serves all of them, and each query's sums run as they
would in a block of its own (a column it does not see adds exact zeros), so the number
never changes its bits. Long passes take it where the engine keeps rows exact
(``row_exact``, and ``model_attention`` for the families whose prefill is mlx-vlm's
own code). Its sums run on CUDA cores, query by query. bfloat16/float16 passes of head
sizes up to 256 take a tensor-core kernel instead (``_FLASH``, ``FLASH_PREFILL``), which
keeps each query's bits independent of the others the same way. Both group a query's
columns by their positions in the prompt, not by where they sit in the cache (a sliding
window's cache holds the last keys of wherever its previous pass ended), so a prompt's
bits do not depend on how its passes were cut (``origin``). Without a GPU, ``tests/
test_cuda_emulated.py`` runs these kernels' source on a CPU emulation of CUDA.
"""

from __future__ import annotations

import functools
import math
import os

import mlx.core as mx

from ...mlx_runtime import cuda_available as available  # noqa: F401 - this module's API: where these kernels run
from ...mlx_runtime import kernel_constant

CHUNK = 256  # columns per block of a prefill pass's pass 1
WARPS = 8  # warps per block of a prefill pass's pass 1: CHUNK // WARPS columns each


def decode_split(value: str) -> tuple[int, int]:
    """``VLM_SERVE_DECODE_SPLIT``'s (CHUNK, WARPS): each warp a whole share of the block's
    columns (the kernel's ``PER_WARP``), at most 32 warps (1,024 threads) a block."""
    try:
        chunk, warps = (int(n) for n in value.split(","))
    except ValueError:
        chunk = warps = 0
    if not (1 <= warps <= 32 and chunk >= warps and chunk % warps == 0):
        raise ValueError(f"VLM_SERVE_DECODE_SPLIT={value!r}: want CHUNK,WARPS with 1-32 warps "
                         "sharing CHUNK columns evenly, as 128,4")
    return chunk, warps


# Decode's pass 1 in blocks of DECODE_CHUNK columns on DECODE_WARPS warps (env
# ``VLM_SERVE_DECODE_SPLIT=CHUNK,WARPS``). Smaller blocks fill the SMs more evenly: at
# 256 on 8, Gemma-3-4B's 64 rows were 1.94 waves of 3 blocks an SM. ncu, H200, 34
# layers at 64 rows, pipelined, both passes: 4.86 ms at 128 on 4 against 5.48 at 256 on
# 8 (``bench/decode_kernels.py --split``). A row's bits follow the split, and every row
# of every batch gets the same one.
DECODE_CHUNK, DECODE_WARPS = decode_split(os.environ.get("VLM_SERVE_DECODE_SPLIT", "128,4"))
# Loads a lane of pass 1 has in flight at once, where its sums are few
# (``loads_in_flight``): runs of its column's key, and columns' values of its dims (each
# a trip to memory the lane has nothing else to do during). Any number gives the bits of
# one at a time. H200, Gemma-3-4B shape, B=64 rows of ~580 keys, 34 layers under ncu:
# 3.13 ms at 1 and 1, 2.47 at 4 and 4, 2.55 at 8 and 8 (76 and 100 registers a thread
# against 60; ``bench/decode_kernels.py``).
KEY_LOADS = 4
VALUE_LOADS = 4
# Stages of decode's pass 1 pipeline (``pipeline_stages``). A warp's keys and values
# reach shared memory by asynchronous copies, in 1 KB pieces, all stages but one in
# flight while the lanes sum the oldest, instead of each lane loading into registers.
# Each lane sums the same terms in the same order, so the bits are the same.
# - Why: pass 1 waits on memory's round trips (ncu, H200: DRAM 46% busy, 3 blocks an SM
#   by registers; ``bench/results/gpu-h200-decode-attention-probes``), and registers
#   bound the loads a lane keeps in flight. Copies need none.
# - nvcc for sm_90, Gemma 3's heads at 5 stages: 82 registers and 43,136 B of shared
#   memory a block, against 74 and 18,560 without. Still 3 blocks an SM.
# - ncu, H200, 34 layers at 64 rows (``bench/decode_kernels.py --part attention
#   --pipeline N``): pass 1 4.95 ms at 5 stages against 5.34 with each lane's own loads.
# - 0 turns it off (``VLM_SERVE_ATTENTION_PIPELINE=0``).
PIPELINE = int(os.environ.get("VLM_SERVE_ATTENTION_PIPELINE", "5"))
# A piece of the pipeline: this many 16-byte runs of each of a warp's 32 keys, or this
# many columns' value rows (1 KB each for Gemma 3's heads).
PIECE_RUNS = 2
PIECE_COLUMNS = 2
# A lane's weighted values (floats) up to which it takes those loads: Gemma 3's. Wider
# sums already hold the registers the loads would take (nvcc for sm_90: Qwen2.5-VL's 7
# heads of 128 from 128 to 142 registers a thread, one block an SM instead of two;
# Gemma 4's heads of 512 from 72 to 122), and have not been timed with them.
FEW_SUMS = 16
# At most this many floats of query heads per block (QG * head dim): each head keeps its
# query in shared memory, its output slice in registers and its warps' outputs in
# shared memory.
GROUP_FLOATS = 1024

_HEADER = f"""
constexpr int PIECE_RUNS = {PIECE_RUNS}, PIECE_COLUMNS = {PIECE_COLUMNS};
""" + """
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x += __shfl_xor_sync(0xffffffff, x, offset);
  }
  return __shfl_sync(0xffffffff, x, 0);  // lane 0's order, on every lane
}

// 16 bytes from global to shared memory without waiting for them (cp.async): a thread's
// copies land by the groups it commits (copy_wait). The CPU emulation copies at once.
__device__ __forceinline__ void copy_async(void* shared, const void* global) {
#ifdef __CUDA_ARCH__
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(to), "l"(global) : "memory");
#else
  *static_cast<uint4*>(shared) = *static_cast<const uint4*>(global);
#endif
}

__device__ __forceinline__ void copy_commit() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most N of this thread's committed groups of copies are still in flight.
template <int N>
__device__ __forceinline__ void copy_wait() {
#ifdef __CUDA_ARCH__
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
#endif
}

// A run of STEP elements into registers: one 16-byte load where the run is 16 bytes.
template <typename T, int STEP>
__device__ __forceinline__ void load_run(const T* src, T* dst) {
  if constexpr (STEP * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
    for (int t = 0; t < STEP; ++t) dst[t] = src[t];
  }
}

__device__ __forceinline__ float warp_max(float x) {
  for (int offset = 16; offset > 0; offset /= 2) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, offset));
  }
  return x;
}
"""

# Pass 1 is one body after one of two openings, which say what the block's QQ query
# rows are: one decode row (its own keys, its count of them), or QQ consecutive queries
# of one prompt in a prefill pass (the keys of their prompt, causal and within a window,
# or as a mask gives them). Both set, per query, ``out_row`` (its row of the output, -1
# past the pass's end), ``first``/``count`` (the columns it may attend to) and
# ``visible(qq, c)``; and ``kv_offset`` (the keys' row) and the queries in ``q_s``.
_COMMON = """
  constexpr int VEC = 16 / sizeof(T);  // elements of one 16-byte load
  constexpr int STEP = D % VEC == 0 ? VEC : 1;  // elements per load: rows in whole 16 bytes
  constexpr int SPANS = (D + 32 * STEP - 1) / (32 * STEP);  // a lane's runs of value dims
  constexpr int PER_WARP = CHUNK / WARPS;
  const int chunk = blockIdx.x, group = blockIdx.y;
  const int heads = gridDim.y * QG, chunks = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int columns = keys_shape[2];
  const int head0 = group * QG;  // this block's query heads: head0 .. head0 + QG - 1
  const int kv_head = head0 / (heads / KV_HEADS);
  __shared__ float q_s[QQ][QG][D];
  int out_row[QQ], first[QQ], count[QQ];
"""

_DECODE_ROW = """
  // q (slots, heads, 1, D); keys (slots, KV_HEADS, columns, D): row `row`'s own.
  static_assert(QQ == 1, "one query per decode row");
  const int row = blockIdx.z;
  out_row[0] = row, first[0] = 0, count[0] = min(counts[row], columns);
  constexpr int shift = 0;  // a row's runs start at its column 0
  auto visible = [](int, int) { return true; };
  const size_t kv_offset = ((size_t)row * KV_HEADS + kv_head) * columns * D;
  for (int i = threadIdx.x; i < QG * D; i += blockDim.x) {
    q_s[0][i / D][i % D] = static_cast<float>(q[((size_t)row * heads + head0) * D + i]);
  }
"""

_PREFILL_ROW = """
  // q (B, heads, L, D): a pass's L queries per prompt, the last L of its keys' columns
  // (B, KV_HEADS, columns, D). The block takes queries q0 .. q0 + QQ - 1 of prompt b.
  // Query qi attends to the columns up to its own where CAUSAL (the last WINDOW of them
  // where WINDOW > 0), else to every column; and, where a mask is given, only to those
  // its row of the mask allows (`visible`).
  const int L = q_shape[2], tiles = (L + QQ - 1) / QQ;
  const int b = blockIdx.z / tiles, q0 = (blockIdx.z % tiles) * QQ;
#pragma unroll
  for (int qq = 0; qq < QQ; ++qq) {
    const int qi = q0 + qq;
    out_row[qq] = qi < L ? b * L + qi : -1;
    count[qq] = qi >= L ? 0 : CAUSAL ? columns - L + qi + 1 : columns;
    first[qq] = WINDOW > 0 ? max(0, count[qq] - WINDOW) : 0;
  }
  const size_t kv_offset = ((size_t)b * KV_HEADS + kv_head) * columns * D;
  const int shift = column_shift[0];  // runs and chunks start this many columns before 0
  VISIBLE
  for (int i = threadIdx.x; i < QQ * QG * D; i += blockDim.x) {
    const int qq = i / (QG * D), h = i / D % QG, d = i % D;
    q_s[qq][h][d] = q0 + qq < L
        ? static_cast<float>(q[(((size_t)b * heads + head0 + h) * L + q0 + qq) * D + d]) : 0.0f;
  }
"""

# Which columns of ``first .. count`` a prefill query attends to: all, or those its row
# of ``mask`` (1 or B, L, columns: one set of rows for every prompt, or one per prompt)
# allows. The mask's first axis is read at run time: a template argument would compile
# the kernel anew for every number of prompts sharing a pass.
_ALL_VISIBLE = """
  auto visible = [](int, int) { return true; };
"""
_MASK_VISIBLE = """
  const bool* mask_rows = mask + ((size_t)(mask_shape[0] == 1 ? 0 : b) * L + q0) * columns;
  auto visible = [&](int qq, int c) { return mask_rows[(size_t)qq * columns + c]; };
"""

# Each lane loads a column's key and value once for the block's QQ queries and QG heads,
# and each query's sums run as they would with the query alone in its block: a column
# another query sees and this one does not adds exact zeros to it.
_PARTIAL = """
  const T* k_row = keys + kv_offset;
  const T* v_row = values + kv_offset;
  __syncthreads();

  // Lane `lane` owns value dims (span * 32 + lane) * STEP .. + STEP.
  float o[QQ][QG][SPANS][STEP], m[QQ][QG], l[QQ][QG];
#pragma unroll
  for (int qq = 0; qq < QQ; ++qq) {
#pragma unroll
    for (int h = 0; h < QG; ++h) {
#pragma unroll
      for (int j = 0; j < SPANS; ++j) for (int t = 0; t < STEP; ++t) o[qq][h][j][t] = 0.0f;
      m[qq][h] = NEG_INF;
      l[qq][h] = 0.0f;
    }
  }
  const int run = chunk * CHUNK + warp * PER_WARP - shift;  // this warp's fixed run of columns
  int stop[QQ], last = run;
#pragma unroll
  for (int qq = 0; qq < QQ; ++qq) {
    stop[qq] = min(run + PER_WARP, count[qq]);
    last = max(last, stop[qq]);
  }
  // With PIPELINE stages (2 or more), a round's keys and then its values reach shared
  // memory as pieces (PIECE_RUNS runs of each of its 32 keys, or PIECE_COLUMNS columns'
  // values) by asynchronous copies, which need no registers to wait in: PIPELINE - 1
  // pieces in flight while the lanes sum the oldest. The warps' sums at the end overlay
  // the stages.
  constexpr int RUNS = D / STEP;  // a key's or a value row's runs
  constexpr bool PIPELINED = PIPELINE > 1 && STEP * sizeof(T) == 16;
  // MLX compiles the kernel as a plain function, so the pipelined code compiles even
  // where it does not run: with at least two stages.
  constexpr int STAGES = PIPELINED ? PIPELINE : 2;
  constexpr int KEY_PIECES = (RUNS + PIECE_RUNS - 1) / PIECE_RUNS;
  constexpr int PIECES = KEY_PIECES + 32 / PIECE_COLUMNS;
  constexpr int KEY_WORDS = 32 * PIECE_RUNS, VALUE_WORDS = PIECE_COLUMNS * RUNS;  // 16 bytes each
  constexpr int STAGE_WORDS = KEY_WORDS > VALUE_WORDS ? KEY_WORDS : VALUE_WORDS;
  constexpr int STAGED_WORDS = PIPELINED ? WARPS * STAGES * STAGE_WORDS : 0;
  constexpr int SUM_WORDS = (QG * WARPS * D + 3) / 4;
  __shared__ uint4 pool[STAGED_WORDS > SUM_WORDS ? STAGED_WORDS : SUM_WORDS];
  uint4* my_stages = pool + (PIPELINED ? warp * STAGES * STAGE_WORDS : 0);
  auto stage_of = [&](int piece) { return my_stages + piece % STAGES * STAGE_WORDS; };
  // Key i's runs sit in its row of the stage turned by i's place in 128 bytes, so the
  // lanes reading their own keys' runs at once hit every bank once.
  auto key_slot = [](int i, int r) { return i * PIECE_RUNS + (r ^ (i / (8 / PIECE_RUNS) % PIECE_RUNS)); };
  static_assert(PIECE_RUNS == 1 || PIECE_RUNS == 2 || PIECE_RUNS == 4 || PIECE_RUNS == 8, "whole banks");
  static_assert(32 % PIECE_COLUMNS == 0, "a round's columns in whole pieces");

  // Rounds of 32 columns, one per lane: each lane's dot products run over its own key
  // in dim order, so no lane waits on another's until the round's max and sum. Rounds
  // start at the run's first column whatever a query's first visible one, so a column
  // meets the same lane whether a query's columns come as a count, a window or a mask;
  // a column a query does not see adds nothing to it.
  for (int c0 = run; c0 < last; c0 += 32) {
    const int c = c0 + lane;
    bool valid[QQ], any = false;
#pragma unroll
    for (int qq = 0; qq < QQ; ++qq) {
      valid[qq] = c >= first[qq] && c < stop[qq] && visible(qq, c);
      any = any || valid[qq];
    }
    // The round's columns some query sees: only their keys and values are read (never a
    // value no query sees, which a masked-out padding row may hold as anything).
    const unsigned live = __ballot_sync(0xffffffff, any);
    float s[QQ][QG], p[QQ][QG];
#pragma unroll
    for (int qq = 0; qq < QQ; ++qq) for (int h = 0; h < QG; ++h) s[qq][h] = 0.0f;
    // Key run `r` (of STEP elements) into each query's dot products with the block's heads.
    auto sum_key_run = [&](const T* kv, int r) {
#pragma unroll
      for (int t = 0; t < STEP; ++t) {
        const float kf = static_cast<float>(kv[t]);
#pragma unroll
        for (int qq = 0; qq < QQ; ++qq)
#pragma unroll
          for (int h = 0; h < QG; ++h) s[qq][h] += q_s[qq][h][r * STEP + t] * kf;
      }
    };
    // The round's scores into the running max and sum; p: each column's weight.
    auto fold_scores = [&] {
#pragma unroll
      for (int qq = 0; qq < QQ; ++qq) {
#pragma unroll
        for (int h = 0; h < QG; ++h) {
          s[qq][h] = valid[qq] ? s[qq][h] * SCALE : NEG_INF;
          const float m_new = fmaxf(m[qq][h], warp_max(s[qq][h]));
          p[qq][h] = valid[qq] ? expf(s[qq][h] - m_new) : 0.0f;
          // A round of columns none seen yet (a mask's gap): nothing to rescale.
          const float alpha = m_new == NEG_INF ? 1.0f : expf(m[qq][h] - m_new);
          l[qq][h] = l[qq][h] * alpha + warp_sum(p[qq][h]);
#pragma unroll
          for (int j = 0; j < SPANS; ++j) for (int t = 0; t < STEP; ++t) o[qq][h][j][t] *= alpha;
          m[qq][h] = m_new;
        }
      }
    };
    // Column i of the round's values (this lane's runs of them, from `row`) into the sums.
    auto add_values = [&](int i, auto row) {
      float pc[QQ][QG];
#pragma unroll
      for (int qq = 0; qq < QQ; ++qq)
#pragma unroll
        for (int h = 0; h < QG; ++h) pc[qq][h] = __shfl_sync(0xffffffff, p[qq][h], i);
#pragma unroll
      for (int j = 0; j < SPANS; ++j) {
        const int d0 = (j * 32 + lane) * STEP;
        if (d0 >= D) break;
        alignas(16) T vv[STEP];
        row(j, vv);
#pragma unroll
        for (int t = 0; t < STEP; ++t) {
          const float vf = static_cast<float>(vv[t]);
#pragma unroll
          for (int qq = 0; qq < QQ; ++qq)
#pragma unroll
            for (int h = 0; h < QG; ++h) o[qq][h][j][t] += pc[qq][h] * vf;
        }
      }
    };

    if constexpr (PIPELINED) {
      // Piece n into stage n % STAGES: every lane copies its share, and commits a group
      // for every piece (empty past the last) so that the waits below count pieces.
      auto issue = [&](int piece) {
        uint4* stage = stage_of(piece);
        if (piece < KEY_PIECES) {
          for (int e = lane; e < 32 * PIECE_RUNS; e += 32) {
            const int i = e / PIECE_RUNS, r = piece * PIECE_RUNS + e % PIECE_RUNS;
            if (((live >> i) & 1) && r < RUNS) {
              copy_async(stage + key_slot(i, e % PIECE_RUNS), k_row + (size_t)(c0 + i) * D + r * STEP);
            }
          }
        } else if (piece < PIECES) {
          const int first_column = (piece - KEY_PIECES) * PIECE_COLUMNS;
          for (int e = lane; e < PIECE_COLUMNS * RUNS; e += 32) {
            const int i = first_column + e / RUNS;
            if ((live >> i) & 1) copy_async(stage + e, v_row + (size_t)(c0 + i) * D + e % RUNS * STEP);
          }
        }
        copy_commit();
      };
      __syncwarp();  // the last round's pieces are read
      for (int piece = 0; piece < STAGES - 1; ++piece) issue(piece);
      for (int piece = 0; piece < PIECES; ++piece) {
        copy_wait<STAGES - 2>();  // this lane's copies of `piece` are in
        __syncwarp();  // and every lane's; and every lane is done with piece - 1's stage
        issue(piece + STAGES - 1);  // into piece - 1's stage
        const uint4* stage = stage_of(piece);
        if (piece < KEY_PIECES) {
          if (any) {
#pragma unroll
            for (int r = 0; r < PIECE_RUNS; ++r) {
              if (piece * PIECE_RUNS + r >= RUNS) break;
              alignas(16) T kv[STEP];
              *reinterpret_cast<uint4*>(kv) = stage[key_slot(lane, r)];
              sum_key_run(kv, piece * PIECE_RUNS + r);
            }
          }
          if (piece == KEY_PIECES - 1) fold_scores();
        } else {
          const int first_column = (piece - KEY_PIECES) * PIECE_COLUMNS;
#pragma unroll
          for (int i = 0; i < PIECE_COLUMNS; ++i) {
            if (!((live >> (first_column + i)) & 1)) continue;
            add_values(first_column + i, [&](int j, T* vv) {
              *reinterpret_cast<uint4*>(vv) = stage[i * RUNS + j * 32 + lane];
            });
          }
        }
      }
    } else {
      if (any) {
        // KEY_LOADS of the key's runs loaded at once, then summed in dim order.
        const T* k = k_row + (size_t)c * D;
        for (int r0 = 0; r0 < RUNS; r0 += KEY_LOADS) {
          alignas(16) T kv[KEY_LOADS][STEP];
#pragma unroll
          for (int r = 0; r < KEY_LOADS; ++r) {
            if (r0 + r < RUNS) load_run<T, STEP>(k + (r0 + r) * STEP, kv[r]);
          }
#pragma unroll
          for (int r = 0; r < KEY_LOADS; ++r) {
            if (r0 + r >= RUNS) break;
            sum_key_run(kv[r], r0 + r);
          }
        }
      }
      fold_scores();
      // The round's seen columns in order, VALUE_LOADS columns' values loaded at once.
      static_assert(32 % VALUE_LOADS == 0, "a round's columns in whole groups of loads");
      for (int i0 = 0; i0 < 32; i0 += VALUE_LOADS) {
        const unsigned seen = (live >> i0) & (0xffffffffu >> (32 - VALUE_LOADS));
        if (seen == 0) continue;
        alignas(16) T vv[VALUE_LOADS][SPANS][STEP];
#pragma unroll
        for (int i = 0; i < VALUE_LOADS; ++i) {
          if (!((seen >> i) & 1)) continue;
          const T* v = v_row + (size_t)(c0 + i0 + i) * D;
#pragma unroll
          for (int j = 0; j < SPANS; ++j) {
            const int d0 = (j * 32 + lane) * STEP;
            if (d0 < D) load_run<T, STEP>(v + d0, vv[i][j]);
          }
        }
#pragma unroll
        for (int i = 0; i < VALUE_LOADS; ++i) {
          if (!((seen >> i) & 1)) continue;
          add_values(i0 + i, [&](int j, T* out) {
#pragma unroll
            for (int t = 0; t < STEP; ++t) out[t] = vv[i][j][t];
          });
        }
      }
    }
  }

  // The warps of each query meet in order, one query at a time (their buffers are
  // shared by the block's queries).
  __shared__ float warp_m[QG][WARPS], warp_l[QG][WARPS];
  float (*warp_o)[WARPS][D] = reinterpret_cast<float (*)[WARPS][D]>(pool);
  __syncthreads();  // every warp is done with its stages, which warp_o overlays
#pragma unroll
  for (int qq = 0; qq < QQ; ++qq) {
#pragma unroll
    for (int h = 0; h < QG; ++h) {
      if (lane == 0) { warp_m[h][warp] = m[qq][h]; warp_l[h][warp] = l[qq][h]; }
#pragma unroll
      for (int j = 0; j < SPANS; ++j) {
        const int d0 = (j * 32 + lane) * STEP;
#pragma unroll
        for (int t = 0; t < STEP; ++t) {
          if (d0 + t < D) warp_o[h][warp][d0 + t] = o[qq][h][j][t];
        }
      }
    }
    __syncthreads();
    if (out_row[qq] >= 0) {
#pragma unroll
      for (int h = 0; h < QG; ++h) {
        float top = NEG_INF;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, warp_m[h][w]);
        float* out = partial + (((size_t)out_row[qq] * heads + head0 + h) * chunks + chunk) * (D + 2);
        if (top == NEG_INF) {  // a chunk past the query's count: nothing to add
          for (int d = threadIdx.x; d < D + 2; d += blockDim.x) out[d] = d == D ? NEG_INF : 0.0f;
          continue;
        }
        for (int d = threadIdx.x; d < D; d += blockDim.x) {
          float sum = 0.0f;
          for (int w = 0; w < WARPS; ++w) sum += warp_o[h][w][d] * expf(warp_m[h][w] - top);
          out[d] = sum;
        }
        if (threadIdx.x == 0) {
          float sum = 0.0f;
          for (int w = 0; w < WARPS; ++w) sum += warp_l[h][w] * expf(warp_m[h][w] - top);
          out[D] = top;
          out[D + 1] = sum;
        }
      }
    }
    __syncthreads();
  }
"""

_COMBINE = """
  const int head = blockIdx.y, row = blockIdx.z;
  const int heads = gridDim.y;
  const int chunks = partial_shape[2];
  const float* parts = partial + ((size_t)row * heads + head) * chunks * (D + 2);
  float top = NEG_INF;
  for (int c = 0; c < chunks; ++c) top = fmaxf(top, parts[c * (D + 2) + D]);
  if (top == NEG_INF) {  // a query that sees no column (a mask's padding row): zeros
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[((size_t)row * heads + head) * D + d] = T(0.0f);
    return;
  }
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


# A prefill pass on tensor cores (bfloat16/float16, head dims of 16 to 512 in steps of
# 16): one block per 64 queries of a (prompt, head), a warp per 16 of them (past 256
# dims, 32 queries and two warps per 16, each with half of the dims). Key tiles of
# KB positions (from the prompt's position 0: ``column_shift``) are staged in shared
# memory for the block's warps; each warp multiplies its queries by a tile's keys
# (``mma.sync``), folds the scores into a running max and sum per query (online softmax,
# float32), rounds the weights to T and multiplies them by the tile's values into
# float32 sums. The instruction takes each query row on its own, and the row's max and
# sum meet only the row's own values (its four lanes, in a fixed order), so a query's
# bits follow its own keys and what it sees: a tile it sees nothing of (one another
# query of its warp needs) adds exact zeros to it.
# Where CHUNK > 0, a block takes only the tiles of one chunk of CHUNK columns (chunks
# fixed from position 0, one per blockIdx.z with the prompt) and writes its queries'
# unnormalized sums, max and sum of weights as ``_COMBINE`` reads them; pass 2 meets the
# chunks in order. A chunk a query sees nothing of gives it a max of -inf, which adds
# nothing there, so its bits still follow only its own keys and what it sees; and a pass
# of few queries after many cached keys (a chat's next turn) runs on a block per chunk
# rather than one block walking every tile.
_FLASH = """
  // Past 256 dims a query's sums take two warps, each its half of the dims (both work
  // out the same scores), and tiles are half as wide, to fit registers and shared memory.
  constexpr int HALVES = D > 256 ? 2 : 1;
  constexpr int KB = 32 / HALVES;  // keys per tile
  constexpr int ROWS = 64 / HALVES;  // queries per block: 16 per warp (per pair of warps)
  constexpr int NT = KB / 8;  // tiles of 8 keys in a tile's scores
  constexpr int DT = D / 8 / HALVES;  // tiles of 8 dims in this warp's part of the sums
  constexpr int STRIDE = D + 8;  // elements per staged row: 16 bytes of padding
  __shared__ uint4 k_words[KB * STRIDE * sizeof(T) / 16];
  __shared__ uint4 v_words[KB * STRIDE * sizeof(T) / 16];
  T (*ks)[STRIDE] = reinterpret_cast<T (*)[STRIDE]>(k_words);
  T (*vs)[STRIDE] = reinterpret_cast<T (*)[STRIDE]>(v_words);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int g = lane / 4, t = lane % 4;
  const int L = q_shape[2], heads = gridDim.y, columns = keys_shape[2];
  const int shift = column_shift[0];  // tiles and chunks start this many columns before 0
  const int chunks = CHUNK > 0 ? (columns + shift + CHUNK - 1) / CHUNK : 1;
  const int head = blockIdx.y, b = blockIdx.z / chunks, chunk = blockIdx.z % chunks;
  const int kv_head = head / (heads / KV_HEADS);
  const int q0 = blockIdx.x * ROWS;
  const int row0 = q0 + warp / HALVES * 16 + g;
  const int rows[2] = {row0, row0 + 8};  // this lane's queries
  const int d_first = warp % HALVES * (D / HALVES);  // this warp's first dim of the sums
  const T* q_b = q + ((size_t)b * heads + head) * L * D;
  const T* k_b = keys + ((size_t)b * KV_HEADS + kv_head) * columns * D;
  const T* v_b = values + ((size_t)b * KV_HEADS + kv_head) * columns * D;

  // The columns query qi may see: first .. count - 1, and where `visible` allows.
  auto count_of = [&](int qi) { return qi >= L ? 0 : CAUSAL ? columns - L + qi + 1 : columns; };
  auto first_of = [&](int qi) { return WINDOW > 0 ? max(0, count_of(qi) - WINDOW) : 0; };
  VISIBLE
  int first[2], count[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) first[h] = first_of(rows[h]), count[h] = count_of(rows[h]);
  // The block's tiles: from the first column its first query may see to the last its
  // last query may see (counts and windows only grow with the query).
  const int last_q = min(q0 + ROWS, L) - 1;
  int tile_begin = (first_of(q0) + shift) / KB, tile_end = (count_of(last_q) + shift + KB - 1) / KB;
  if constexpr (CHUNK > 0) {
    static_assert(CHUNK % KB == 0, "chunks of whole tiles");
    tile_begin = max(tile_begin, chunk * (CHUNK / KB));
    tile_end = min(tile_end, (chunk + 1) * (CHUNK / KB));
  }

  // Two elements as one register of the instruction's operands.
  auto pack = [](T lo, T hi) {
    T v[2] = {lo, hi};
    return *reinterpret_cast<unsigned*>(v);
  };
  auto q_pair = [&](int row, int d) {
    return row < L ? *reinterpret_cast<const unsigned*>(q_b + (size_t)row * D + d) : 0u;
  };

  float o[DT][4], m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
#pragma unroll
  for (int n = 0; n < DT; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;

  for (int tile = tile_begin; tile < tile_end; ++tile) {
    const int c0 = tile * KB - shift;
    __syncthreads();  // the last tile's reads are done
    for (int p = threadIdx.x; p < KB * D / 8; p += blockDim.x) {
      const int r = p / (D / 8), e = (p % (D / 8)) * 8;
      uint4 kw = make_uint4(0, 0, 0, 0), vw = make_uint4(0, 0, 0, 0);
      if (c0 + r >= 0 && c0 + r < columns) {
        kw = *reinterpret_cast<const uint4*>(k_b + (size_t)(c0 + r) * D + e);
        vw = *reinterpret_cast<const uint4*>(v_b + (size_t)(c0 + r) * D + e);
      }
      *reinterpret_cast<uint4*>(&ks[r][e]) = kw;
      *reinterpret_cast<uint4*>(&vs[r][e]) = vw;
    }
    __syncthreads();

    // Scores: s[n][e] is row rows[e / 2], column c0 + 8n + 2t + e % 2.
    float s[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
    for (int d0 = 0; d0 < D; d0 += 16) {
      const unsigned a[4] = {q_pair(rows[0], d0 + 2 * t), q_pair(rows[1], d0 + 2 * t),
                             q_pair(rows[0], d0 + 2 * t + 8), q_pair(rows[1], d0 + 2 * t + 8)};
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const unsigned b0 = *reinterpret_cast<const unsigned*>(&ks[n * 8 + g][d0 + 2 * t]);
        const unsigned b1 = *reinterpret_cast<const unsigned*>(&ks[n * 8 + g][d0 + 2 * t + 8]);
        mma16816(s[n], a, b0, b1, T());
      }
    }
    float top[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2, c = c0 + n * 8 + 2 * t + e % 2;
        const bool seen = c >= first[h] && c < count[h] && visible(rows[h], c);
        s[n][e] = seen ? s[n][e] * SCALE : NEG_INF;
        top[h] = fmaxf(top[h], s[n][e]);
      }
    }
    float alpha[2], sum[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffff, top[h], 1));
      top[h] = fmaxf(top[h], __shfl_xor_sync(0xffffffff, top[h], 2));
      const float m_new = fmaxf(m[h], top[h]);
      // A tile of columns the query has seen none of yet: nothing to rescale.
      alpha[h] = m_new == NEG_INF ? 1.0f : expf(m[h] - m_new);
      m[h] = m_new;
      sum[h] = 0.0f;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2;
        s[n][e] = s[n][e] == NEG_INF ? 0.0f : expf(s[n][e] - m[h]);
        sum[h] += s[n][e];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      // The quad's four partial sums, the same on every lane (a + b == b + a).
      sum[h] += __shfl_xor_sync(0xffffffff, sum[h], 1);
      sum[h] += __shfl_xor_sync(0xffffffff, sum[h], 2);
      l[h] = l[h] * alpha[h] + sum[h];
    }
#pragma unroll
    for (int n = 0; n < DT; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[n][e] *= alpha[e / 2];
    // The weights, rounded to T, times the tile's values: 16 keys per instruction.
#pragma unroll
    for (int kk = 0; kk < KB / 16; ++kk) {
      const unsigned a[4] = {
          pack(T(s[2 * kk][0]), T(s[2 * kk][1])), pack(T(s[2 * kk][2]), T(s[2 * kk][3])),
          pack(T(s[2 * kk + 1][0]), T(s[2 * kk + 1][1])), pack(T(s[2 * kk + 1][2]), T(s[2 * kk + 1][3]))};
      const int k0 = kk * 16 + 2 * t;
#pragma unroll
      for (int n = 0; n < DT; ++n) {
        const int d = d_first + n * 8 + g;
        const unsigned b0 = pack(vs[k0][d], vs[k0 + 1][d]);
        const unsigned b1 = pack(vs[k0 + 8][d], vs[k0 + 9][d]);
        mma16816(o[n], a, b0, b1, T());
      }
    }
  }

  if constexpr (CHUNK > 0) {
    // This chunk's part of each query, as _COMBINE reads it: sums, then max and sum.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (rows[h] >= L) continue;
      // out is float32 here; the cast keeps the branch compiling where it is not.
      float* part = reinterpret_cast<float*>(out)
                    + (((size_t)(b * L + rows[h]) * heads + head) * chunks + chunk) * (D + 2);
#pragma unroll
      for (int n = 0; n < DT; ++n)
        for (int e = 0; e < 2; ++e) part[d_first + n * 8 + 2 * t + e] = o[n][2 * h + e];
      if (t == 0 && d_first == 0) part[D] = m[h], part[D + 1] = l[h];
    }
  } else {
#pragma unroll
    for (int n = 0; n < DT; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int h = e / 2, row = rows[h];
        if (row < L) {
          const int d = d_first + n * 8 + 2 * t + e % 2;
          const float value = l[h] > 0.0f ? o[n][e] / l[h] : 0.0f;  // a query that sees nothing: zeros
          out[((size_t)(b * L + row) * heads + head) * D + d] = static_cast<T>(value);
        }
      }
    }
  }
"""

_FLASH_MASK_VISIBLE = """
  auto visible = [&](int qi, int c) {
    return mask[((size_t)(mask_shape[0] == 1 ? 0 : b) * L + qi) * columns + c];
  };
"""


@functools.cache
def _flash_kernel(scale: float, masked: bool):
    from ..cuda_matmul import MMA

    define, tag = kernel_constant("SCALE", scale)
    return mx.fast.cuda_kernel(
        name=f"vlm_flash_prefill_{'masked' if masked else 'plain'}_{tag}",
        input_names=["q", "keys", "values"] + (["mask"] if masked else []) + ["column_shift"],
        output_names=["out"],
        source=_FLASH.replace("  VISIBLE\n", _FLASH_MASK_VISIBLE if masked else _ALL_VISIBLE),
        header=_HEADER + MMA + define,
    )


@functools.cache
def _kernels(scale: float, opening: str = "decode"):
    """Pass 1 and pass 2 for one scale and one kind of row: "decode", "prefill" or
    "masked" (a prefill pass with a mask)."""
    define, tag = kernel_constant("SCALE", scale)
    header = _HEADER + define
    row = _DECODE_ROW if opening == "decode" else _PREFILL_ROW.replace(
        "  VISIBLE\n", _MASK_VISIBLE if opening == "masked" else _ALL_VISIBLE)
    inputs = {"decode": ["counts"], "prefill": ["column_shift"], "masked": ["mask", "column_shift"]}[opening]
    partial = mx.fast.cuda_kernel(
        name=f"vlm_{opening}_attention_partial_{tag}",
        input_names=["q", "keys", "values", *inputs],
        output_names=["partial"],
        source=_COMMON + row + _PARTIAL,
        header=header,
    )
    combine = mx.fast.cuda_kernel(
        name=f"vlm_{opening}_attention_combine_{tag}",
        input_names=["partial"],
        output_names=["out"],
        source=_COMBINE,
        header=header,
    )
    return partial, combine


def heads_per_block(heads: int, kv_heads: int, dim: int) -> int:
    """Query heads one block of pass 1 computes: the most of one key/value head's that
    divide them evenly within ``GROUP_FLOATS``."""
    shared = heads // kv_heads
    return max(g for g in range(1, shared + 1) if shared % g == 0 and g * dim <= max(dim, GROUP_FLOATS))


def decode_attention(
    q: mx.array, keys: mx.array, values: mx.array, counts: mx.array, scale: float,
    group: int | None = None,
) -> mx.array:
    """``q`` (slots, heads, 1, dim); ``keys``/``values`` the store's (slots, kv_heads,
    columns, dim); ``counts`` (slots,) int32: how many leading columns each row
    attends to. ``group``: query heads per block of pass 1 (default
    ``heads_per_block``; any divisor of the heads sharing a key/value head gives the
    same bits). Returns (slots, heads * dim) in ``q``'s dtype."""
    slots, heads, _, dim = q.shape
    group = group or heads_per_block(heads, keys.shape[1], dim)
    template = [("QQ", 1), ("PIPELINE", pipeline_stages(group, dim, q.dtype))]
    return _attention(_kernels(scale), [q, keys, values, counts], slots, slots, heads, dim, group, template,
                      0, (DECODE_CHUNK, DECODE_WARPS))


def pipeline_stages(group: int, dim: int, dtype: mx.Dtype) -> int:
    """``PIPELINE`` where a decode block's lanes keep few sums (``FEW_SUMS``: wider ones
    already hold the registers, and nvcc gives Qwen2.5-VL's 7 heads of 128 142 registers
    a thread with stages against 128 without: one block an SM instead of two), its keys
    are 16-bit (the types checked on a GPU) in 16-byte runs, and its stages fit in 48 KB
    of shared memory beside its queries (its warps' sums overlay the stages); else 0,
    each lane's own loads."""
    step = run_elements(dim, dtype)
    if PIPELINE < 2 or dtype.size != 2 or step * dtype.size != 16 or lane_sums(group, dim, dtype) > FEW_SUMS:
        return 0
    runs = dim // step
    stages = DECODE_WARPS * PIPELINE * 16 * max(32 * PIECE_RUNS, PIECE_COLUMNS * runs)
    shared = max(stages, 4 * group * DECODE_WARPS * dim) + 4 * group * dim + 8 * group * DECODE_WARPS
    return PIPELINE if shared <= 48 * 1024 else 0


# The most queries of a prefill pass a block of pass 1 takes by default. Any number gives
# each query the same bits (``tests/test_cuda_attention.py::test_queries_sharing_a_block_
# compute_what_each_computes_alone``), but more did not pay on an H200 (Gemma-3-4B shape,
# 34 layers: 3.2 / 3.5 / 4.1 / 4.0 ms at 1 / 2 / 4 / 8 for 270 tokens, 70 / 65 / 78 / 62
# ms for 2,048; ``bench/attention_kernels.py --prefill-lengths``), so one.
MAX_QUERIES_PER_BLOCK = 1


def queries_per_block(group: int, dim: int, dtype: mx.Dtype, length: int) -> int:
    """Queries of a prefill pass per block of pass 1: each key and value a lane loads
    serves them all. As many as keep each lane's sums in registers (at most 64 floats
    of weighted values: nvcc for sm_90 then gives the Gemma-3-4B shape's pass 134
    registers a thread at 4 queries, 250 at 8) and the block's queries and warps in
    shared memory, up to 8, and no more than the pass has. Any number gives each query
    the same bits."""
    per_query = lane_sums(group, dim, dtype)
    fits = [n for n in (8, 4, 2, 1) if n <= min(MAX_QUERIES_PER_BLOCK, queries_in_shared_memory(group, dim))
            and n * per_query <= 64]
    return next(n for n in fits if n == 1 or n // 2 < length)


def run_elements(dim: int, dtype: mx.Dtype) -> int:
    """Elements of a run that pass 1 loads at once (the kernels' ``STEP``): 16 bytes
    where rows of ``dim`` are whole 16-byte runs, else one."""
    step = 16 // dtype.size
    return step if dim % step == 0 else 1


def lane_sums(group: int, dim: int, dtype: mx.Dtype) -> int:
    """The weighted values (floats) a lane of pass 1 keeps for one query of ``group``
    heads of ``dim``: its runs of each head's value dims."""
    step = run_elements(dim, dtype)
    return group * -(-dim // (32 * step)) * step


def loads_in_flight(group: int, dim: int, dtype: mx.Dtype, queries: int) -> tuple[int, int]:
    """A lane's loads in flight of keys and of values: ``KEY_LOADS`` and
    ``VALUE_LOADS`` where its sums for the block's ``queries`` are few (``FEW_SUMS``),
    else one at a time."""
    if queries * lane_sums(group, dim, dtype) <= FEW_SUMS:
        return KEY_LOADS, VALUE_LOADS
    return 1, 1


def queries_in_shared_memory(group: int, dim: int) -> int:
    """The most queries a block of ``group`` heads of ``dim`` can hold beside its warps'
    sums in 40 KB of shared memory (of the 48 KB a kernel may declare)."""
    return max(1, (40 * 1024) // (4 * group * dim) - WARPS)


def prefill_attention(
    q: mx.array, keys: mx.array, values: mx.array, scale: float, window: int | None = None,
    group: int | None = None, causal: bool = True, mask: mx.array | None = None,
    queries: int | None = None, origin: int = 0,
) -> mx.array:
    """A prefill pass's attention: ``q`` (prompts, heads, L, dim), the queries of the
    last L of the keys' columns; ``keys``/``values`` (prompts, kv_heads, columns, dim).
    Each query attends causally, to at most the last ``window`` columns up to its own
    where given (mlx-lm's causal masks), or to every column where not ``causal``; and
    where ``mask`` (1 or prompts, L, columns; bool) is given, only to the columns its
    row allows. Returns (prompts * L, heads * dim): each query's heads side by side, as
    the output projection takes them. A query reads its prompt's keys only, so other
    prompts in the pass never change it; and its sums follow the columns it sees, not
    how they are given (a causal count, a window or a mask), nor which queries share
    its block (``queries`` per block: default ``queries_per_block``).

    ``origin``: the position in the prompt of the keys' column 0 (``key_origin``).
    The kernels group a query's columns into runs, tiles and chunks, and rounding
    follows the grouping; they group by position, so a query gets the same bits
    whether its keys start at position 0 (a whole prompt) or later (a sliding window's
    cache after an earlier pass, which may have ended anywhere)."""
    if FLASH_PREFILL and flash_fits(q) and queries is None:
        return flash_prefill_attention(q, keys, values, scale, window, causal, mask, origin=origin)
    prompts, heads, length, dim = q.shape
    group = group or heads_per_block(heads, keys.shape[1], dim)
    queries = queries or queries_per_block(group, dim, q.dtype, length)
    template = [("QQ", queries), ("CAUSAL", causal), ("WINDOW", (window or 0) if causal else 0),
                ("PIPELINE", 0)]
    shift = column_shift(origin)
    inputs = [q, keys, values] + ([] if mask is None else [mask]) + [_shift_input(shift)]
    opening = "prefill" if mask is None else "masked"
    blocks = prompts * -(-length // queries)
    return _attention(_kernels(scale, opening), inputs, prompts * length, blocks, heads, dim,
                      group, template, shift, (CHUNK, WARPS))


def key_origin(offset, keys: mx.array) -> int:
    """The position of ``keys``' column 0 in its prompt, where an mlx-lm layer cache
    at ``offset`` (just updated) returned them: the offset less their columns, so 0 for
    a cache that keeps every key; a sliding window's cache keeps the last of them. 0
    where the offset is not one number (a batch cache's)."""
    return max(0, offset - keys.shape[2]) if isinstance(offset, int) else 0


# Runs, tiles and chunks of the prefill kernels all start at multiples of this many
# positions: the per-query kernel's chunks, of which its warps' runs and the
# tensor-core kernel's tiles are divisors.
ALIGN = CHUNK


def column_shift(origin: int, flash_chunk: int | None = None) -> int:
    """Columns the kernels' grouping starts before column 0 for keys from ``origin``
    on, so that it falls on the same positions whatever ``origin`` is."""
    return origin % math.lcm(ALIGN, flash_chunk or ALIGN)


@functools.cache
def _shift_input(shift: int) -> mx.array:
    return mx.array([shift], mx.int32)


# Prefill passes of bfloat16/float16 queries of a head size the tensor-core kernel takes
# run on it (``_FLASH``) rather than on the per-query kernel, whatever their length, so a
# query's bits never depend on the pass it is in (``tests/test_cuda_attention.py``). Its
# sums are its own (weights rounded to T, products summed by the tensor cores). H200,
# Gemma-3-4B shape, 34 layers: 17 against 70 ms for 2,048 tokens, 3.1 against 3.2 ms
# for 270 (``bench/attention_kernels.py --prefill-lengths``).
FLASH_PREFILL = True


# The widest heads the tensor-core prefill kernel takes by default. Up to 512 (Gemma 4's
# full-attention layers) it can: past 256 two warps share a query's sums, each half of
# the dims; that has run only on the CPU emulation, so 256 until a GPU run has checked
# and measured it (``tests/test_cuda_attention.py``, ``bench/attention_kernels.py``).
FLASH_MAX_DIM = 256


def flash_fits(q: mx.array) -> bool:
    """Whether the tensor-core prefill kernel takes queries like ``q``."""
    dim = q.shape[-1]
    return q.dtype in (mx.bfloat16, mx.float16) and dim % 16 == 0 and 16 <= dim <= FLASH_MAX_DIM


def flash_queries_per_block(dim: int) -> int:
    """Queries a block of the tensor-core prefill kernel takes (its ``ROWS``): 16 per
    warp, or past 256 dims 16 per pair of warps."""
    return 64 if dim <= 256 else 32


# Columns per block of the tensor-core prefill kernel, in chunks fixed from position 0 and
# met by a second pass (``_COMBINE``); None: one block walks all of a query's columns.
# Chunks give a short pass after a long cached prefix (a chat's next turn) a block per
# chunk instead of one per 64 queries of a head (a 16-token turn after 2,048 keys: 72
# blocks of the Gemma-3-4B shape instead of 8), at the cost of a pass that writes and
# reads each query's parts (float32, (dim + 2) per query, head and chunk: 135 MB a layer
# for a 2,048-token prompt of that shape in chunks of 256, as the per-query kernel
# writes). Either gives a query the same bits in any pass; the two give different bits
# from each other. None until a GPU run has measured both
# (``bench/attention_kernels.py --prefill-lengths 16,64,2048 --cached 2048``).
FLASH_CHUNK: int | None = None


def flash_prefill_attention(
    q: mx.array, keys: mx.array, values: mx.array, scale: float, window: int | None = None,
    causal: bool = True, mask: mx.array | None = None, chunk: int | None = None, origin: int = 0,
) -> mx.array:
    """``prefill_attention`` on tensor cores (where ``flash_fits``): the same arguments
    and the same result up to rounding; a query's bits follow only its own keys, their
    positions and the columns it sees. ``chunk``: columns per block, a multiple of 32,
    or 0 for all of them (default ``FLASH_CHUNK``)."""
    prompts, heads, length, dim = q.shape
    if chunk is None:
        chunk = FLASH_CHUNK or 0
    shift = column_shift(origin, chunk)
    chunks = -(-(keys.shape[2] + shift) // chunk) if chunk else 1
    inputs = [q, keys, values] + ([] if mask is None else [mask]) + [_shift_input(shift)]
    (out,) = _flash_kernel(scale, mask is not None)(
        inputs=inputs,
        template=[("T", q.dtype), ("D", dim), ("KV_HEADS", keys.shape[1]), ("CAUSAL", causal),
                  ("WINDOW", (window or 0) if causal else 0), ("CHUNK", chunk)],
        grid=(-(-length // flash_queries_per_block(dim)) * 128, heads, prompts * chunks),
        threadgroup=(128, 1, 1),
        output_shapes=[(prompts * length, heads, chunks, dim + 2) if chunk else (prompts * length, heads * dim)],
        output_dtypes=[mx.float32 if chunk else q.dtype],
    )
    return _combine(_kernels(scale, "prefill")[1], out, q.dtype) if chunk else out


def _attention(kernels, inputs: list, rows: int, blocks: int, heads: int, dim: int,
               group: int, template: list, shift: int, split: tuple[int, int]) -> mx.array:
    """Pass 1 (``blocks`` blocks of queries per chunk and group of heads) then pass 2
    over ``rows`` query rows (``inputs``: q, keys, values, ...; ``shift``: the columns
    the chunks start before column 0; ``split``: a chunk's columns and its warps)."""
    q, keys = inputs[0], inputs[1]
    kv_heads, columns = keys.shape[1], keys.shape[2]
    chunk, warps = split
    chunks = max(1, -(-(columns + shift) // chunk))
    partial_kernel, combine_kernel = kernels
    key_loads, value_loads = loads_in_flight(group, dim, q.dtype, dict(template)["QQ"])
    template = [("T", q.dtype), ("D", dim), ("KV_HEADS", kv_heads), ("QG", group),
                ("CHUNK", chunk), ("WARPS", warps), *template, ("KEY_LOADS", key_loads),
                ("VALUE_LOADS", value_loads)]
    (partial,) = partial_kernel(
        inputs=inputs,
        template=template,
        grid=(chunks * warps * 32, heads // group, blocks),
        threadgroup=(warps * 32, 1, 1),
        output_shapes=[(rows, heads, chunks, dim + 2)],
        output_dtypes=[mx.float32],
    )
    return _combine(combine_kernel, partial, q.dtype)


def _combine(combine_kernel, partial: mx.array, dtype: mx.Dtype) -> mx.array:
    """Pass 2: each query's parts (rows, heads, chunks, dim + 2) met in chunk order,
    as (rows, heads * dim) of ``dtype``."""
    rows, heads, _, width = partial.shape
    (out,) = combine_kernel(
        inputs=[partial],
        template=[("T", dtype), ("D", width - 2)],
        grid=(128, heads, rows),
        threadgroup=(128, 1, 1),
        output_shapes=[(rows, heads * (width - 2))],
        output_dtypes=[dtype],
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


def reference_prefill_attention(
    q: mx.array, keys: mx.array, values: mx.array, scale: float, window: int | None = None,
    group: int | None = None, causal: bool = True, mask: mx.array | None = None,
) -> mx.array:
    """What ``prefill_attention`` computes, through MLX's own attention with the mask
    its arguments describe (to compare with, and to stand in for the kernels where
    CUDA is not). ``group`` changes no value and is ignored."""
    prompts, heads, length, dim = q.shape
    columns = keys.shape[2]
    visible = mx.ones((length, columns), mx.bool_)
    if causal:
        own = mx.arange(columns - length, columns)[:, None]  # each query's own column
        visible = mx.arange(columns)[None, :] <= own
        if window:
            visible = visible & (mx.arange(columns)[None, :] > own - window)
    visible = visible[None] if mask is None else visible[None] & mask
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=visible[:, None])
    return out.transpose(0, 2, 1, 3).reshape(prompts * length, heads * dim)
