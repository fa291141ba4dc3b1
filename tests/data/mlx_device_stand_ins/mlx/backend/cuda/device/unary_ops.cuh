// A stand-in for MLX's device header of the same name, which MLX compiles into its CUDA
// library rather than shipping as a file: enough for nvcc to check the engine's kernels
// that call its functors (tests/test_cuda_sources.py). Not MLX's arithmetic.
#pragma once
namespace mlx::core::cu {
struct Tanh {
  __device__ __nv_bfloat16 operator()(__nv_bfloat16 x) { return __float2bfloat16(tanhf(__bfloat162float(x))); }
};
}  // namespace mlx::core::cu
