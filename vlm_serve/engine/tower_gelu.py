"""The vision towers' GELU of 16-bit activations in a faster form, to MLX's bits.

A bfloat16 or float16 activation has 65,536 possible values, so a form of an
elementwise function can be checked against MLX's own on every input there is. Two
forms:

- ``table``: at load, MLX's own GELU runs once over every value, and each GELU then
  gathers its outputs from that table. On the CPU ~5x faster than MLX's chain of ops
  (``bench/tower_gelu.py``). On CUDA slower: MLX's gather took 70 ms of kernels for
  Gemma 3's tower over 16 images on an H200, where MLX's two GELU kernels took 51 ms
  (``bench/results/gpu-h200-decode-phase``).
- ``cube``: MLX's tanh approximation with its ``x**3`` (a ``powf``, a kernel of its
  own on CUDA, 35 of those 51 ms) computed as a float32 product, exact for a bfloat16
  input, then rounded once as MLX rounds its power; the rest as MLX writes it, all in
  one compiled function. On the CPU ~1.4x faster than MLX's ops. On an H200 its two
  kernels took 24 ms of Gemma 3's tower over 16 images where MLX's two took 51 ms.
- ``kernel`` (CUDA only): the cube form's chain in one kernel of the engine's own, each
  step by MLX's own device functions in the dtypes MLX computes it in (``Multiply``,
  ``Add``, ``Tanh`` from its CUDA headers; the constants rounded by MLX as it rounds
  them). The cube form takes two kernels, since MLX's compiler splits the chain: they
  read and write ~10 bytes an element where one kernel needs 4 (the second alone took
  ~300 us a launch for 8 images on an H200, its bytes ~220 us). On CUDA the default: on
  an H200 it took 13 ms of Gemma 3's tower over 16 images where the cube's two kernels
  took 24 (the tower's kernels 248 ms against 259 ms with the cube and 286 ms with MLX's
  ops; ``bench/gpu/decode_phase.sh``'s tower part).

By default the CPU takes ``table``, CUDA ``kernel``, and Metal MLX's ops (not measured
there); ``VLM_SERVE_TOWER_GELU=table|cube|kernel|mlx`` picks one everywhere. Each form
is checked at load on every value, with the values at other offsets in an array and in
a strided view (MLX could compute an element differently there), and where any bit
differs from MLX's op that GELU keeps MLX's ops. A ``kernel`` form that fails to build
or to check (an MLX whose device headers differ) gives way to ``cube`` first.
"""

from __future__ import annotations

import logging
import math
import os
from functools import lru_cache, partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..mlx_runtime import cuda_available

log = logging.getLogger("vlm_serve.engine")

FORMS = ("table", "cube", "kernel", "mlx")
# The form a GELU takes where its own form fails for every dtype.
FALLBACK = {"kernel": "cube"}
# One of FORMS everywhere; unset: "table" on the CPU, "kernel" on CUDA, "mlx" elsewhere.
SETTING = os.environ.get("VLM_SERVE_TOWER_GELU")
DTYPES = (mx.bfloat16, mx.float16)
TANH = ("precise", "tanh")  # nn.GELU's names for the tanh approximation

# (form, approximation, dtype) -> the checked form's function, or None: MLX's ops
_forms: dict[tuple[str, str, mx.Dtype], Callable[[mx.array], mx.array] | None] = {}


def every_value(dtype: mx.Dtype) -> mx.array:
    """All 65,536 values of a 16-bit float type, in the order of their bits."""
    return mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(dtype)


def lookup(table: mx.array, x: mx.array) -> mx.array:
    return mx.take(table, x.view(mx.uint16))


@partial(mx.compile, shapeless=True)
def gelu_cube(x: mx.array) -> mx.array:
    """``nn.gelu_approx`` with its cube as an exact float32 product (see above)."""
    wide = x.astype(mx.float32)
    cube = (wide * wide * wide).astype(x.dtype)
    return 0.5 * x * (1 + mx.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * cube)))


# The cube form's chain on each element, 16 bytes a thread where the input is aligned.
_KERNEL_HEADER = """
#include "mlx/backend/cuda/device/binary_ops.cuh"
#include "mlx/backend/cuda/device/unary_ops.cuh"
"""
_KERNEL = """
  constexpr int PER_THREAD = 16 / sizeof(T);
  size_t size = 1;
  for (int d = 0; d < x_ndim; ++d) size *= x_shape[d];
  const size_t first = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * PER_THREAD;
  if (first >= size) return;
  // 0.044715, sqrt(2 / pi), 1 and 0.5 as MLX rounds them to T.
  const T cube_scale = constants[0], scale = constants[1], one = constants[2], half = constants[3];
  auto gelu = [&](T v) {
    const float wide = static_cast<float>(v);
    const T cube = static_cast<T>(Multiply{}(Multiply{}(wide, wide), wide));
    const T inner = Add{}(v, Multiply{}(cube_scale, cube));
    return Multiply{}(Multiply{}(half, v), Add{}(one, Tanh{}(Multiply{}(scale, inner))));
  };
  const bool aligned = reinterpret_cast<uintptr_t>(x + first) % 16 == 0;
  if (aligned && first + PER_THREAD <= size) {
    alignas(16) T v[PER_THREAD];
    *reinterpret_cast<uint4*>(v) = *reinterpret_cast<const uint4*>(x + first);
#pragma unroll
    for (int i = 0; i < PER_THREAD; ++i) v[i] = gelu(v[i]);
    *reinterpret_cast<uint4*>(out + first) = *reinterpret_cast<const uint4*>(v);
  } else {
    for (size_t i = first; i < size && i < first + PER_THREAD; ++i) out[i] = gelu(x[i]);
  }
"""


@lru_cache(maxsize=None)
def _gelu_kernel():
    return mx.fast.cuda_kernel(name="vlm_tower_gelu", input_names=["x", "constants"], output_names=["out"],
                               source=_KERNEL, header=_KERNEL_HEADER)


@lru_cache(maxsize=None)
def _constants(dtype: mx.Dtype) -> mx.array:
    """The cube form's scalars as MLX rounds them in its ops on ``dtype`` (a Python
    float times an array of ``dtype``; times one, exactly). Built with the form, at load."""
    one = mx.ones((1,), dtype)
    constants = mx.concatenate([one * c for c in (0.044715, math.sqrt(2 / math.pi), 1, 0.5)])
    mx.eval(constants)
    return constants


def gelu_kernel(x: mx.array) -> mx.array:
    """``nn.gelu_approx`` as ``gelu_cube`` computes it, in one CUDA kernel."""
    per_block = 256 * (16 // x.dtype.size)
    (out,) = _gelu_kernel()(inputs=[x, _constants(x.dtype)], template=[("T", x.dtype)],
                            grid=(-(-x.size // per_block) * 256, 1, 1), threadgroup=(256, 1, 1),
                            output_shapes=[x.shape], output_dtypes=[x.dtype])
    return out


def form_here() -> str:
    if SETTING is not None:
        if SETTING not in FORMS:
            raise ValueError(f"VLM_SERVE_TOWER_GELU={SETTING!r}: one of {', '.join(FORMS)}")
        return SETTING
    if mx.default_device().type == mx.DeviceType.cpu:
        return "table"
    return "kernel" if cuda_available() else "mlx"


def _build(form: str, approx: str, dtype: mx.Dtype) -> Callable[[mx.array], mx.array] | None:
    if form == "cube":
        return gelu_cube if approx in TANH else None
    if form == "kernel":
        return gelu_kernel if approx in TANH and cuda_available() else None
    table = nn.GELU(approx=approx)(every_value(dtype))
    mx.eval(table)
    return partial(lookup, table)


def _same_everywhere(f, gelu: nn.GELU, dtype: mx.Dtype) -> bool:
    """Whether ``f`` gives MLX's bits on every value, with the values past a few leading
    elements (other vector lanes and tails), in a view that starts there, and in a
    strided view."""
    values = every_value(dtype)
    shifted = mx.concatenate([mx.zeros((7,), dtype), values])
    strided = values.reshape(256, 256).T
    return all(mx.array_equal(f(x).view(mx.uint16), gelu(x).view(mx.uint16)).item()
               for x in (values, shifted, shifted[3:], strided))


def checked_form(form: str, approx: str, dtype: mx.Dtype) -> Callable[[mx.array], mx.array] | None:
    """``form`` of the GELU ``approx`` (as ``nn.GELU`` takes it) for ``dtype`` inputs,
    or None where it does not apply or misses MLX's bits. Built and checked on first
    call: call it at load, never inside a compiled trace."""
    key = (form, approx, dtype)
    if key not in _forms:
        f = _build(form, approx, dtype)
        try:
            same = f is not None and _same_everywhere(f, nn.GELU(approx=approx), dtype)
        except Exception as exc:  # noqa: BLE001 - a form this backend cannot run: MLX's ops
            log.warning("GELU (%s, %s): MLX's ops (the %s form failed: %s)", approx, dtype, form, exc)
            same = None
        if same is False and f is not None:
            log.warning("GELU (%s, %s): MLX's ops (the %s form differs in some bits)", approx, dtype, form)
        _forms[key] = f if same else None
    return _forms[key]


class _FasterGELU(nn.GELU):
    _form: str  # set by install

    def __call__(self, x):
        f = _forms.get((self._form, self._approx, x.dtype))
        return f(x) if f is not None else super().__call__(x)


def install(model: nn.Module) -> int:
    """Point ``model``'s ``nn.GELU`` layers at this device's form for 16-bit inputs, in
    place, each form checked now. Returns how many layers have a form for some dtype."""
    form = form_here()
    if form == "mlx":
        return 0
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.GELU:
            # Every dtype's form is built and checked now, not inside a compiled trace.
            for candidate in (form, FALLBACK.get(form)):
                if candidate and any([checked_form(candidate, module._approx, dtype) for dtype in DTYPES]):
                    module.__class__ = _FasterGELU
                    module._form = candidate
                    count += 1
                    break
    return count
