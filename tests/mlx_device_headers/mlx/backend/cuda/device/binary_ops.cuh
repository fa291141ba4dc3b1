// Stands in for MLX's CUDA device header of the same name (embedded in MLX's CUDA
// library, not installed as a file), for tests/test_cuda_sources.py's compile checks:
// the two functors the engine's kernels use, as MLX 0.32.4 defines them.
#pragma once

namespace mlx::core::cu {

struct Add {
  template <typename T>
  __device__ T operator()(T x, T y) { return x + y; }
};

struct Multiply {
  template <typename T>
  __device__ T operator()(T x, T y) { return x * y; }
};

}  // namespace mlx::core::cu
