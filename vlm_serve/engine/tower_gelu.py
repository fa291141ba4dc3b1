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
  one compiled function. On the CPU ~1.4x faster than MLX's ops. On CUDA the default:
  on an H200 its two kernels took 24 ms of Gemma 3's tower over 16 images where MLX's
  two took 51 ms (the tower's kernels 260 ms against 287 ms).

By default the CPU takes ``table``, CUDA ``cube``, and Metal MLX's ops (not measured
there); ``VLM_SERVE_TOWER_GELU=table|cube|mlx`` picks one everywhere. Each form
is checked at load on every value, with the values at other offsets in an array and in
a strided view (MLX could compute an element differently there), and where any bit
differs from MLX's op that GELU keeps MLX's ops.
"""

from __future__ import annotations

import logging
import math
import os
from functools import partial
from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from ..mlx_runtime import cuda_available

log = logging.getLogger("vlm_serve.engine")

FORMS = ("table", "cube", "mlx")
# One of FORMS everywhere; unset: "table" on the CPU, "cube" on CUDA, "mlx" elsewhere.
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


def form_here() -> str:
    if SETTING is not None:
        if SETTING not in FORMS:
            raise ValueError(f"VLM_SERVE_TOWER_GELU={SETTING!r}: one of {', '.join(FORMS)}")
        return SETTING
    if mx.default_device().type == mx.DeviceType.cpu:
        return "table"
    return "cube" if cuda_available() else "mlx"


def _build(form: str, approx: str, dtype: mx.Dtype) -> Callable[[mx.array], mx.array] | None:
    if form == "cube":
        return gelu_cube if approx in TANH else None
    table = nn.GELU(approx=approx)(every_value(dtype))
    mx.eval(table)
    return partial(lookup, table)


def _same_everywhere(f, gelu: nn.GELU, dtype: mx.Dtype) -> bool:
    """Whether ``f`` gives MLX's bits on every value, with the values past a few leading
    elements (other vector lanes and tails) and in a strided view."""
    values = every_value(dtype)
    shifted = mx.concatenate([mx.zeros((7,), dtype), values])
    strided = values.reshape(256, 256).T
    return all(mx.array_equal(f(x).view(mx.uint16), gelu(x).view(mx.uint16)).item()
               for x in (values, shifted, strided))


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
            forms = [checked_form(form, module._approx, dtype) for dtype in DTYPES]
            if any(f is not None for f in forms):
                module.__class__ = _FasterGELU
                module._form = form
                count += 1
    return count
