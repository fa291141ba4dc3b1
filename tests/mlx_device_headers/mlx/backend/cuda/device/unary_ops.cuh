// Stands in for MLX's CUDA device header of the same name (see binary_ops.cuh): the
// functor the engine's kernels use, as MLX 0.32.4 defines it.
#pragma once
#include <cuda/std/cmath>

namespace mlx::core::cu {

struct Tanh {
  template <typename T>
  __device__ T operator()(T x) { return cuda::std::tanh(x); }
};

}  // namespace mlx::core::cu
