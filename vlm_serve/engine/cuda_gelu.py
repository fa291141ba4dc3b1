"""The tanh-approximated GELU of bfloat16 activations as one CUDA kernel, to MLX's bits.

MLX's ``nn.gelu_approx`` is a chain of ops, each rounded to bfloat16. On CUDA, MLX
0.32.4 runs it as two kernels: ``x**3`` alone, then the rest. So each activation makes
a round trip through memory in between. In Gemma 3's vision tower that GELU was 18% of
the tower's time (``bench/results/gpu-h200-burst-phases``, section 5).

Here it is one kernel. It calls MLX's own op functors (``Multiply``, ``Add``, ``Power``,
``Tanh``, from the headers MLX compiles its kernels with) on the same bfloat16 values,
in the order of MLX's generated source, so each value gets MLX's bits. A check at first
use compares the two on probe values and keeps MLX's ops where any bit differs.

``install`` points a model's ``nn.GELU`` layers of that approximation (the vision
towers' MLPs) at it. Gemma's MLP activation, ``gelu(gate) * up``, stays on MLX's one
fused kernel: a kernel like this one that wrote it straight into the down projection's
padded pass (34 launches fewer a Gemma-3-4B step) left the step's GPU time as it was,
and the image burst's decode phase took 0.24 s longer with it on an H200
(``bench/results/gpu-h200-gelu-kernels``).
"""

from __future__ import annotations

import functools
import logging
import os

import mlx.core as mx
import mlx.nn as nn

from ..mlx_runtime import cuda_available, exact_grid_block

log = logging.getLogger("vlm_serve.engine")

# VLM_SERVE_GELU_KERNEL=0 leaves every GELU to MLX's ops (for comparison).
ENABLED = os.environ.get("VLM_SERVE_GELU_KERNEL", "1") != "0"

_HEADER = ('#include "mlx/backend/cuda/device/unary_ops.cuh"\n'
           '#include "mlx/backend/cuda/device/binary_ops.cuh"\n')

# MLX's chain for a bfloat16 x, each step rounded to bfloat16 (its constants are
# bfloat16 too: 0.044715 and sqrt(2 / pi) round to the values written here):
#   (x * 0.5) * (tanh((x + x**3 * 0.0446777344) * 0.796875) + 1)
_GELU_OF = """
  auto gelu_of = [](__nv_bfloat16 a) {
    const __nv_bfloat16 halved = Multiply{}(a, static_cast<__nv_bfloat16>(0.5));
    const __nv_bfloat16 cubed = Multiply{}(Power{}(a, static_cast<__nv_bfloat16>(3)),
                                           static_cast<__nv_bfloat16>(0.0446777344));
    const __nv_bfloat16 inner = Multiply{}(Add{}(a, cubed), static_cast<__nv_bfloat16>(0.796875));
    return Multiply{}(halved, Add{}(Tanh{}(inner), static_cast<__nv_bfloat16>(1)));
  };
"""

# One value a thread (2-byte loads: any view's data is aligned for them); each grid is
# exactly its output's values.
_SOURCE = _GELU_OF + """
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  out[i] = gelu_of(x[i]);
"""

# A grid in blocks smaller than this (values a power of two times an odd number below
# it) is not worth a kernel of its own; one past MAX_GRID threads is more than MLX's
# grid takes.
MIN_BLOCK = 32
MAX_GRID = 2**31 - 1


def gelu_approx(x: mx.array) -> mx.array:
    """``nn.gelu_approx(x)``: one kernel where it applies and was checked, else MLX's."""
    if not (x.dtype == mx.bfloat16 and _grid_fits(x.size) and _checked()):
        return nn.gelu_approx(x)
    return _kernel_gelu(x)


def _grid_fits(threads: int) -> bool:
    return exact_grid_block(threads) >= MIN_BLOCK and threads <= MAX_GRID


def _kernel_gelu(x: mx.array) -> mx.array:
    (out,) = _kernel()(
        inputs=[x],
        grid=(x.size, 1, 1),
        threadgroup=(exact_grid_block(x.size), 1, 1),
        output_shapes=[x.shape],
        output_dtypes=[x.dtype],
    )
    return out


@functools.cache
def _kernel():
    return mx.fast.cuda_kernel(name="vlm_gelu_approx", input_names=["x"], output_names=["out"],
                               header=_HEADER, source=_SOURCE)


@functools.cache
def _checked() -> bool:
    """Whether the kernel gives MLX's bits on probe values: normals across the range
    where the tanh matters and beyond, and every bfloat16 from -8 to 8. Logs why not
    where it does not."""
    if not cuda_available():
        return False
    probes = mx.concatenate([
        (mx.random.normal((1 << 16,), key=mx.random.key(0)) * 4).astype(mx.bfloat16),
        mx.arange(-8, 8, 2 ** -7, dtype=mx.float32).astype(mx.bfloat16),
    ])
    try:
        same = mx.array_equal(_kernel_gelu(probes), nn.gelu_approx(probes)).item()
    except Exception as exc:  # noqa: BLE001 - a kernel that does not build: MLX's ops
        log.warning("GELU: MLX's ops (the one kernel failed: %s)", exc)
        return False
    if not same:
        log.warning("GELU: MLX's ops (the one kernel differs from them in some bits)")
    return same


class _KernelGELU(nn.GELU):
    def __call__(self, x):
        if self._approx in ("precise", "tanh"):
            return gelu_approx(x)
        return super().__call__(x)


def install(model: nn.Module) -> int:
    """Point ``model``'s tanh-approximated ``nn.GELU`` layers at ``gelu_approx``, in
    place, where the kernel was checked (on CUDA; elsewhere nothing). Returns how many."""
    if not (ENABLED and _checked()):  # (False off CUDA) checked here, never inside a compiled trace
        return 0
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.GELU and module._approx in ("precise", "tanh"):
            module.__class__ = _KernelGELU
            count += 1
    return count
