// A stand-in for MLX's device header of the same name, which MLX compiles into its CUDA
// library rather than shipping as a file: enough for nvcc to check the engine's kernels
// that call its functors (tests/test_cuda_sources.py). Not MLX's arithmetic.
#pragma once
namespace mlx::core::cu {
struct Add {
  __device__ __nv_bfloat16 operator()(__nv_bfloat16 a, __nv_bfloat16 b) { return __hadd(a, b); }
};
struct Multiply {
  __device__ __nv_bfloat16 operator()(__nv_bfloat16 a, __nv_bfloat16 b) { return __hmul(a, b); }
};
struct Power {
  __device__ __nv_bfloat16 operator()(__nv_bfloat16 a, __nv_bfloat16 b) {
    return __float2bfloat16(powf(__bfloat162float(a), __bfloat162float(b)));
  }
};
}  // namespace mlx::core::cu
