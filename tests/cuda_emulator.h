// The CUDA the engine's kernels use, emulated on the CPU (tests/test_cuda_emulated.py): one
// OS thread per CUDA thread, one block at a time, so `__shared__` arrays are function
// statics; warp shuffles, ballots and mma.sync go through a per-warp exchange between
// barriers. The emulated mma adds each output's 16 products in k order, then the
// accumulator: not the hardware's own order, but one fixed order, which is what checks of
// a kernel's structure need (which operands meet, in which order). Build with
// -fno-strict-aliasing: the kernels read T arrays through uint4 pointers.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>
#include <vector_functions.h>
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>
using std::max;
using std::min;

struct Idx { unsigned x = 0, y = 0, z = 0; };
inline thread_local Idx threadIdx, blockIdx;
inline Idx gridDim, blockDim;

struct WarpState {
  std::barrier<>* bar;
  uint64_t slot[32];
  unsigned frag[32][6];
};
inline thread_local WarpState* my_warp;
inline thread_local std::barrier<>* my_block;

#undef __global__
#define __global__
#undef __device__
#define __device__
#undef __forceinline__
#define __forceinline__ inline
#undef __shared__
#define __shared__ static
#define __syncthreads() my_block->arrive_and_wait()

template <class V>
inline V warp_exchange(V v, int src) {
  WarpState& w = *my_warp;
  const int lane = threadIdx.x % 32;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  w.slot[lane] = bits;
  w.bar->arrive_and_wait();
  uint64_t got = w.slot[src & 31];
  w.bar->arrive_and_wait();
  V out;
  std::memcpy(&out, &got, sizeof(V));
  return out;
}
inline float __shfl_sync(unsigned, float v, int src) { return warp_exchange(v, src); }
inline float __shfl_xor_sync(unsigned, float v, int m) { return warp_exchange(v, (int)(threadIdx.x % 32) ^ m); }
inline unsigned __ballot_sync(unsigned, bool p) {
  WarpState& w = *my_warp;
  const int lane = threadIdx.x % 32;
  w.slot[lane] = p ? 1 : 0;
  w.bar->arrive_and_wait();
  unsigned mask = 0;
  for (int i = 0; i < 32; ++i) mask |= (w.slot[i] ? 1u : 0u) << i;
  w.bar->arrive_and_wait();
  return mask;
}
inline void __syncwarp(unsigned = 0xffffffff) { my_warp->bar->arrive_and_wait(); }
inline int __ffs(unsigned x) { return x ? __builtin_ctz(x) + 1 : 0; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

inline float half_bits(unsigned short b, __nv_bfloat16) { unsigned u = (unsigned)b << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float half_bits(unsigned short b, __half) { __half h; std::memcpy(&h, &b, 2); return __half2float(h); }

// mma.sync.m16n8k16.row.col, f32 accumulation: each output's 16 products summed in k
// order, then added to the accumulator (the hardware's own order is its own; this one
// is fixed, which is what the structural checks need).
template <typename T>
inline void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1, T) {
  WarpState& w = *my_warp;
  const int lane = threadIdx.x % 32;
  for (int i = 0; i < 4; ++i) w.frag[lane][i] = a[i];
  w.frag[lane][4] = b0;
  w.frag[lane][5] = b1;
  w.bar->arrive_and_wait();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, t = l % 4;
    auto lo = [&](unsigned r) { return half_bits((unsigned short)(r & 0xffff), T()); };
    auto hi = [&](unsigned r) { return half_bits((unsigned short)(r >> 16), T()); };
    const unsigned* f = w.frag[l];
    A[g][2 * t] = lo(f[0]); A[g][2 * t + 1] = hi(f[0]);
    A[g + 8][2 * t] = lo(f[1]); A[g + 8][2 * t + 1] = hi(f[1]);
    A[g][2 * t + 8] = lo(f[2]); A[g][2 * t + 9] = hi(f[2]);
    A[g + 8][2 * t + 8] = lo(f[3]); A[g + 8][2 * t + 9] = hi(f[3]);
    B[2 * t][g] = lo(f[4]); B[2 * t + 1][g] = hi(f[4]);
    B[2 * t + 8][g] = lo(f[5]); B[2 * t + 9][g] = hi(f[5]);
  }
  const int g = lane / 4, t = lane % 4;
  const int rs[4] = {g, g, g + 8, g + 8}, cs[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  float out[4];
  for (int e = 0; e < 4; ++e) {
    float s = 0.0f;
    for (int k = 0; k < 16; ++k) s += A[rs[e]][k] * B[k][cs[e]];
    out[e] = c[e] + s;
  }
  w.bar->arrive_and_wait();
  for (int e = 0; e < 4; ++e) c[e] = out[e];
}

// Run `kernel` over the grid, one block at a time, one OS thread per CUDA thread (the
// same threads for every block; each block gets barriers of its own, since a thread that
// returns early drops out of them).
inline void launch(Idx grid, Idx block, const std::function<void()>& kernel) {
  gridDim = grid;
  blockDim = block;
  const int threads = block.x * block.y * block.z;
  const int warps = (threads + 31) / 32;
  std::barrier<> between(threads);
  std::barrier<>* block_bar = nullptr;
  std::vector<WarpState> states(warps);
  auto fresh = [&] {
    block_bar = new std::barrier<>(threads);
    for (int w = 0; w < warps; ++w) states[w].bar = new std::barrier<>(std::min(32, threads - 32 * w));
  };
  auto release = [&] {
    delete block_bar;
    for (auto& state : states) delete state.bar;
  };
  fresh();
  std::vector<std::thread> pool;
  for (int i = 0; i < threads; ++i) {
    pool.emplace_back([&, i] {
      threadIdx = {(unsigned)i, 0, 0};
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = {bx, by, bz};
            my_block = block_bar;
            my_warp = &states[i / 32];
            kernel();
            my_warp->bar->arrive_and_drop();
            my_block->arrive_and_drop();
            between.arrive_and_wait();  // every thread is done with this block's barriers
            if (i == 0) {
              release();
              fresh();
            }
            between.arrive_and_wait();  // the next block's barriers are there
          }
    });
  }
  for (auto& th : pool) th.join();
  release();
}
