"""MLX's own matmul on padded passes (``padded_matmul``, ``VLM_SERVE_MATMUL=padded``).

The property it rests on (a row's bits do not follow the pass size from a checked floor
on) is a GPU's, measured by ``bench/gpu/matmul_row_floors.py``; on the CPU MLX's matmul
has it at every size. So here the padded product must give every row the plain
product's bits, and the check's search is driven by a product that adds terms in two
halves below a row count, as cuBLAS's split of a long input dimension does on a GPU
(standing in for the GPU, which is not here)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_vlm import load

from vlm_serve.engine import cuda_matmul, padded_matmul, row_exact
from vlm_serve.engine.families import family_for
from vlm_serve.fixtures.build import cached_model


@pytest.fixture(autouse=True)
def fresh_floors(monkeypatch):
    monkeypatch.setattr(padded_matmul, "_FLOORS", {})


def _layers():
    mx.random.seed(3)
    linear = nn.Linear(64, 96)
    quantized = nn.QuantizedLinear.from_linear(nn.Linear(128, 64), group_size=64, bits=4)
    return [("linear", linear, 64), ("quantized", quantized, 128), ("table", nn.Embedding(200, 64), 64)]


@pytest.mark.parametrize("rows", [1, 5, 300, 2100])
def test_a_padded_pass_gives_each_row_the_plain_products_bits(rows):
    for name, layer, width in _layers():
        x = mx.random.normal((rows, 1, width))
        plain = layer.as_linear(x) if isinstance(layer, nn.Embedding) else layer(x)
        padded = padded_matmul.linear(x, layer, padded_matmul.floor_of(layer))
        assert padded.shape == plain.shape and padded.dtype == plain.dtype, name
        assert mx.array_equal(padded, plain).item(), name
    layer = nn.Linear(64, 32)
    layer.set_dtype(mx.bfloat16)  # float32 rows: rounded to the layer's dtype
    x = mx.random.normal((rows, 64))
    padded = padded_matmul.linear(x, layer, padded_matmul.floor_of(layer))
    assert padded.dtype == mx.float32
    assert mx.array_equal(padded, layer(x.astype(mx.bfloat16)).astype(mx.float32)).item()


def _split_below(rows: int):
    plain = padded_matmul.product

    def product(x, module):
        if x.shape[0] >= rows:
            return plain(x, module)
        half = x.shape[1] // 2  # the input dimension in two parts, summed after
        return x[:, :half] @ module.weight[:, :half].T + x[:, half:] @ module.weight[:, half:].T

    return product


def test_the_check_finds_the_size_from_which_rows_keep_their_bits(monkeypatch):
    layer = nn.Linear(256, 32, bias=False)
    monkeypatch.setattr(padded_matmul, "product", _split_below(264))
    assert padded_matmul.check(layer) == 320  # the first size of the ladder from 264
    assert padded_matmul.pass_size(3, 320) == 320 and padded_matmul.pass_size(700, 320) == 704


def test_a_shape_whose_floor_would_cost_too_much_stays_on_the_kernel(monkeypatch):
    layer = nn.Linear(256, 32, bias=False)
    monkeypatch.setattr(padded_matmul, "product", _split_below(padded_matmul.MAX_FLOOR + 1))
    assert padded_matmul.check(layer) is None


@pytest.fixture
def padded_as_if_cuda(monkeypatch):
    """``cuda_matmul.available`` says CUDA, so that load makes its CUDA choices; the
    kernel itself cannot run here, and no layer may reach it."""
    monkeypatch.setattr(cuda_matmul, "available", lambda: True)
    monkeypatch.setattr(row_exact, "_USE_KERNEL", True)
    monkeypatch.setattr(row_exact, "_PADDED", True)
    monkeypatch.setattr(row_exact.model_attention, "route", lambda lm: [])

    def no_kernel(x, module):
        raise AssertionError("a checked shape reached the row-exact kernel")

    monkeypatch.setattr(cuda_matmul, "linear", no_kernel)


def test_every_layer_of_a_model_and_its_step_takes_the_padded_product(padded_as_if_cuda):
    model, _ = load(str(cached_model("gemma3")))
    family = family_for(model)
    assert family.batched
    decoder = family.decoder()  # its fused layers are shapes of their own, checked as it builds
    shapes = {key[0] for key in padded_matmul._FLOORS}
    qkv = decoder.layers[0].qkv.module.weight.shape
    assert tuple(qkv) in shapes and all(padded_matmul._FLOORS.values())
    layer = model.language_model.model.layers[0].self_attn.q_proj
    x = mx.random.normal((3, 7, layer.weight.shape[1]))
    assert mx.array_equal(layer(x), x @ layer.weight.T).item()


def test_a_quantized_shape_whose_product_strays_from_its_weights_stays_on_the_kernel(monkeypatch):
    """As MLX 0.32.4's CUDA 4-bit matmul does for narrow layers past one row."""
    _, layer, _ = _layers()[1]
    assert padded_matmul.check(layer) == padded_matmul.SIZES[0]
    plain = padded_matmul.product
    monkeypatch.setattr(padded_matmul, "product", lambda x, m: plain(x, m) * (x.shape[0] == 1))
    assert padded_matmul.check(layer) is None


def test_a_product_that_changes_from_run_to_run_stays_on_the_kernel(monkeypatch):
    layer = nn.Linear(256, 32, bias=False)
    plain, largest = padded_matmul.product, []

    def drifting(x, module):  # alike across sizes, but not the largest pass run twice
        largest.extend([1] if x.shape[0] == padded_matmul.SIZES[-1] else [])
        return plain(x, module) + (len(largest) > 1) * 1e-3

    monkeypatch.setattr(padded_matmul, "product", drifting)
    assert padded_matmul.check(layer) is None
