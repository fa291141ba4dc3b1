"""The row-exact matmul (``engine/cuda_matmul.py``) and its installation (``engine/
row_exact.py``): close to MLX's matmul, and a row's result the same to the bit whatever
the number of rows beside it. They run only where MLX has its CUDA backend (skipped
elsewhere, CI included)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_vlm import load

from vlm_serve.engine import cuda_matmul, row_exact
from vlm_serve.engine.families import family_for

pytestmark = pytest.mark.skipif(not cuda_matmul.available(), reason="needs MLX's CUDA backend")

ROW_COUNTS = (1, 2, 7, 16, 17, 33, 64, 65, 130)


def _layer(width: int, out: int, dtype, bias: bool, bits: int | None = None, group: int = 64,
           seed: int = 0) -> nn.Module:
    layer = nn.Linear(width, out, bias=bias)
    rng = np.random.default_rng(seed)
    layer.weight = mx.array(rng.standard_normal((out, width)).astype(np.float32) / width ** 0.5).astype(dtype)
    if bias:
        layer.bias = mx.array(rng.standard_normal(out).astype(np.float32)).astype(dtype)
    if bits:
        layer = nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)
    mx.eval(layer.parameters())
    return layer


def _rows(count: int, width: int, dtype, seed: int = 1) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((count, width)).astype(np.float32)).astype(dtype)


def _assert_row_exact(layer, x):
    alone = [cuda_matmul.linear(x[i:i + 1], layer) for i in range(x.shape[0])]
    for m in [m for m in ROW_COUNTS if m <= x.shape[0]]:
        batched = cuda_matmul.linear(x[:m], layer)
        for i in range(0, m, max(1, m // 5)):
            assert mx.array_equal(batched[i], alone[i][0]).item(), f"row {i} of {m} differs from alone"


PLAIN = [(2560, 4096, False), (2048, 2560, True), (10240, 640, False), (72, 100, True), (200, 37, False)]


def _float64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("width,out,bias", PLAIN)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_plain_weights_match_float64_and_each_row_is_exact(width, out, bias, dtype):
    """Against float64 sums of the same inputs (MLX's own float32 matmul on CUDA may
    round its inputs to TensorFloat-32, so it is no closer than this)."""
    layer = _layer(width, out, dtype, bias)
    assert cuda_matmul.fits(layer, dtype)
    x = _rows(max(ROW_COUNTS), width, dtype)
    ours = cuda_matmul.linear(x, layer)
    assert ours.dtype == dtype and ours.shape == (x.shape[0], out)
    expected = _float64(x) @ _float64(layer.weight).T + (_float64(layer.bias) if bias else 0.0)
    tol = 1e-4 if dtype == mx.float32 else 2e-2  # the output's own rounding, for 16 bits
    np.testing.assert_allclose(_float64(ours), expected, atol=tol, rtol=tol)
    _assert_row_exact(layer, x)


@pytest.mark.parametrize("bits", [None, 4])
def test_rows_loaded_ahead_give_the_same_bits(bits, monkeypatch):
    """Blocks of few rows load the next chunk's rows with its weights: every output the
    same to the bit as loading them just before their multiply-adds, as blocks of at
    most 32 rows at every row count, and with the grid's other block order (column
    blocks first or row blocks first)."""
    layer = _layer(2560, 1024, mx.bfloat16, True, bits)
    x = _rows(130, 2560, mx.bfloat16)
    for m in (1, 7, 16, 17, 33, 64, 65, 130):
        default = cuda_matmul.linear(x[:m], layer)
        with monkeypatch.context() as patch:
            patch.setattr(cuda_matmul, "PREFETCH_ROWS_MAX_TILES", 0)
            patch.setattr(cuda_matmul, "SMALL_BLOCK_ROWS", 0)
            not_ahead = cuda_matmul.linear(x[:m], layer)
        with monkeypatch.context() as patch:
            patch.setattr(cuda_matmul, "ROW_TILES", (1, 2))
            small_blocks = cuda_matmul.linear(x[:m], layer)
            patch.setattr(cuda_matmul, "ROW_BLOCKS_FIRST", not cuda_matmul.ROW_BLOCKS_FIRST)
            rows_first = cuda_matmul.linear(x[:m], layer)
        assert mx.array_equal(not_ahead, default).item(), f"{m} rows"
        assert mx.array_equal(small_blocks, default).item(), f"{m} rows, blocks of 32"
        assert mx.array_equal(rows_first, default).item(), f"{m} rows, the other block order"


@pytest.mark.parametrize("bits,group", [(4, 64), (4, 32), (4, 128), (8, 64)])
def test_quantized_weights_match_mlx_and_each_row_is_exact(bits, group):
    layer = _layer(2560, 1024, mx.bfloat16, True, bits, group)
    assert cuda_matmul.fits(layer, mx.bfloat16)
    x = _rows(max(ROW_COUNTS), 2560, mx.bfloat16)
    ours, theirs = cuda_matmul.linear(x, layer), layer(x)
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)),
                               atol=5e-2, rtol=5e-2)
    _assert_row_exact(layer, x)


def test_a_tied_output_layer_and_leading_axes():
    table = nn.Embedding(300, 128)
    table.weight = _rows(300, 128, mx.bfloat16, 3)
    x = _rows(12, 128, mx.bfloat16).reshape(3, 4, 128)
    out = cuda_matmul.linear(x, table)
    assert out.shape == (3, 4, 300)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)),
                               np.array(table.as_linear(x).astype(mx.float32)), atol=3e-2, rtol=3e-2)


def test_inputs_of_another_dtype_are_rounded_to_the_layers():
    layer = _layer(256, 64, mx.bfloat16, True)
    x = _rows(9, 256, mx.float32)
    out = cuda_matmul.linear(x, layer)
    assert out.dtype == mx.float32  # as MLX's matmul promotes
    assert mx.array_equal(out, cuda_matmul.linear(x.astype(mx.bfloat16), layer).astype(mx.float32)).item()
    _assert_row_exact(layer, x)


def test_what_the_kernel_cannot_take():
    layer = _layer(256, 64, mx.bfloat16, False)
    assert not cuda_matmul.fits(layer, mx.float16)  # inputs of another dtype
    assert not cuda_matmul.fits(_layer(256, 64, mx.bfloat16, False, bits=3), mx.bfloat16)


def test_installed_on_a_model_and_its_images_share_tower_calls_of_checked_sizes(model_path):
    model, _ = load(str(model_path("gemma3")))
    family = family_for(model)
    assert family.batched and family.batch_vision and family.tower_sharing is not None
    assert row_exact.install(model.language_model) == []  # all already installed
    kinds = {type(m).__name__ for _, m in model.language_model.named_modules()}
    assert "Linear" not in kinds and "_ExactLinear" in kinds
