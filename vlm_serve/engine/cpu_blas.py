"""On the CPU, which BLAS multiplies, and whether it gives a row the same bits batched.

MLX's CPU backend multiplies float32 matrices through ``sgemm_`` (half precision with
its own code). The ``mlx-cpu`` wheel bundles the reference BLAS, which adds each dot
product's terms in one order whatever the row count: the parity suite proves batched
rows equal rows alone on it. A faster BLAS in its place (preloaded with
``LD_PRELOAD=.../libopenblas.so.0``, or linked by an MLX built from source; OpenBLAS
multiplied 64x2560 by 2560x4096 in float32 in 9.5 ms against the reference's 557 ms
on a 2-core CPU) chooses its kernels by the matrices' shapes, and some of them split a
dot product by the row count: OpenBLAS does on a tiny test model's output table. So where
another BLAS serves ``sgemm_``, the model's float32 product shapes are checked once at
load, rows multiplied in batches of the sizes a server runs against the same rows
alone, and a model whose rows differ is served one row at a time.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from .weight_layout import for_matmul

log = logging.getLogger("vlm_serve.engine")

# Rows a check multiplies together: decode batches, and prefill passes (512 tokens a
# pass by default on the CPU, shared by the prompts in it).
CHECK_ROWS = (2, 3, 8, 16, 33, 64, 128, 512)
# Output features a check keeps of a layer: all of a linear layer's, at most this many of
# a vocabulary's table (a dot product's terms run over the input features, kept whole).
CHECK_OUT_FEATURES = 32768
BUNDLED = "mlx_cpu.libs"  # where the mlx-cpu wheel keeps its reference BLAS


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def blas_library() -> str | None:
    """The library that serves MLX's ``sgemm_``: one the process's global scope offers
    (preloaded, it takes MLX's calls), else the one MLX's own libraries link; None where
    neither has the symbol."""
    # None: the global scope; then MLX's extension (dlopen hands back the loaded one).
    for path in (None, getattr(mx, "__file__", None)):
        try:
            address = ctypes.cast(ctypes.CDLL(path).sgemm_, ctypes.c_void_p).value
        except (AttributeError, OSError, TypeError):  # no such symbol, or no such library
            continue
        info = _DlInfo()
        try:
            found = ctypes.CDLL(None).dladdr(ctypes.c_void_p(address), ctypes.byref(info))
        except AttributeError:  # a libc without dladdr: the library stays unnamed
            found = 0
        return info.dli_fname.decode(errors="replace") if found and info.dli_fname else "an unnamed library"
    return None


def inexact_reason(language_model: nn.Module) -> str | None:
    """Why batched rows could differ from rows alone on this CPU's BLAS, or None where
    they cannot (the bundled BLAS, or another one that kept every checked row's bits)."""
    if mx.default_device() != mx.cpu:
        return None
    blas = blas_library()
    if blas is None or BUNDLED in blas:
        return None
    # Only float32 products go through the BLAS; MLX multiplies half precision itself.
    shapes = sorted((s for s in _product_shapes(language_model) if s[1] == mx.float32), key=lambda s: s[0])
    differing = [shape for shape, dtype in shapes if not _keeps_row_bits(shape, dtype)]
    library = Path(blas).name
    if differing:
        out_features, in_features = differing[0]
        return (f"on the CPU, {library} gives rows of {len(differing)} product shape(s) other bits "
                f"batched than alone (the first: {in_features} inputs to {out_features} outputs)")
    log.info("CPU: %s multiplies; checked %d product shapes at %s rows: rows keep their bits",
             library, len(shapes), ", ".join(map(str, CHECK_ROWS)))
    return None


# Layers the engine's decode steps fuse into one product (``decode.fused.fuse_linears``).
FUSED = (("q_proj", "k_proj", "v_proj"), ("q_proj", "k_proj"), ("gate_proj", "up_proj"))


def _product_shapes(language_model: nn.Module) -> set[tuple[tuple[int, int], mx.Dtype]]:
    """(out, in) shapes and dtypes of the float products the model's rows go through:
    linear layers, tables (one may be the output layer), and the decode step's fusions."""
    shapes = set()
    for _, module in language_model.named_modules():
        if type(module) in (nn.Linear, nn.Embedding):
            shapes.add((tuple(module.weight.shape), module.weight.dtype))
        for names in FUSED:
            parts = [module.get(name) for name in names]
            if all(type(p) is nn.Linear for p in parts):
                out_features = sum(p.weight.shape[0] for p in parts)
                shapes.add(((out_features, parts[0].weight.shape[1]), parts[0].weight.dtype))
    return shapes


def _keeps_row_bits(shape: tuple[int, int], dtype: mx.Dtype) -> bool:
    """Whether rows of ``x @ W.T`` get the same bits at every CHECK_ROWS count as alone,
    with ``W`` laid out as the model's weights are (``weight_layout``): the BLAS is
    called as the model calls it."""
    out_features, in_features = shape
    key = mx.random.key(0)
    w = for_matmul(mx.random.normal((min(out_features, CHECK_OUT_FEATURES), in_features), key=key).astype(dtype))
    x = mx.random.normal((max(CHECK_ROWS), in_features), key=mx.random.split(key)[0]).astype(dtype)
    for rows in CHECK_ROWS:
        picked = sorted({0, rows // 2, rows - 1})
        together = (x[:rows] @ w.T)[mx.array(picked)]
        alone = mx.concatenate([x[i:i + 1] @ w.T for i in picked])
        if not mx.array_equal(together, alone).item():
            return False
    return True
