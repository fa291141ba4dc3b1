"""GELU as a table lookup (``engine/gelu_table.py``): MLX's bits on every 16-bit value,
wherever it sits in an array, and a real vision tower's features unchanged."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_vlm import load

from vlm_serve.engine import gelu_table
from vlm_serve.fixtures.build import cached_model

APPROXIMATIONS = ("none", "precise", "tanh", "fast")


@pytest.mark.parametrize("dtype", gelu_table.DTYPES, ids=str)
@pytest.mark.parametrize("approx", APPROXIMATIONS)
def test_the_table_gives_mlx_bits_on_every_value(approx, dtype):
    """Every value of the type, NaNs and infinities included."""
    table = gelu_table.table_for(approx, dtype)
    assert table is not None and table.shape == (1 << 16,) and table.dtype == dtype
    values = gelu_table.every_value(dtype)
    mlx_gelu = nn.GELU(approx=approx)(values)
    assert mx.array_equal(gelu_table.lookup(table, values).view(mx.uint16), mlx_gelu.view(mx.uint16)).item()


def test_views_and_odd_sizes_get_mlx_bits():
    """An activation of a tower's width, a transposed view and a size with few factors
    of two."""
    table = gelu_table.table_for("precise", mx.bfloat16)
    x = (mx.random.normal((3, 97, 4304), key=mx.random.key(1)) * 3).astype(mx.bfloat16)
    for view in (x, x.transpose(2, 0, 1), x.reshape(-1)[: 63 * 97]):
        assert mx.array_equal(gelu_table.lookup(table, view), nn.gelu_approx(view)).item()


def test_a_vision_tower_gives_the_same_features_with_it(monkeypatch):
    """Gemma 3's tower (the tiny fixture) with and without ``install`` (wherever MLX
    runs, not only where it is the default): in float32 (no table: MLX's op) and in
    bfloat16 (a lookup in each layer)."""
    monkeypatch.setattr(gelu_table, "SETTING", "1")
    lookups = []
    monkeypatch.setattr(gelu_table, "lookup", lambda table, x: lookups.append(x.dtype) or mx.take(
        table, x.view(mx.uint16)))
    plain, _ = load(str(cached_model("gemma3")))
    model, _ = load(str(cached_model("gemma3")))
    assert gelu_table.install(model) > 0
    assert any(isinstance(m, gelu_table._TableGELU) for _, m in model.vision_tower.named_modules())
    size = model.config.vision_config.image_size
    pixels = mx.random.normal((2, size, size, 3), key=mx.random.key(3))
    for dtype in (mx.float32, mx.bfloat16):
        plain.set_dtype(dtype)
        model.set_dtype(dtype)
        features = model.vision_tower(pixels.astype(dtype), output_hidden_states=True)[0]
        assert features.dtype == dtype
        assert set(lookups) == ({dtype} if dtype != mx.float32 else set())
        assert mx.array_equal(features, plain.vision_tower(pixels.astype(dtype), output_hidden_states=True)[0]).item()


def test_switched_off_it_leaves_the_model_alone(monkeypatch):
    monkeypatch.setattr(gelu_table, "SETTING", "0")
    model, _ = load(str(cached_model("gemma3")))
    assert gelu_table.install(model) == 0
    assert not any(isinstance(m, gelu_table._TableGELU) for _, m in model.named_modules())


def test_by_default_only_the_cpu_uses_it(monkeypatch):
    """Unset, the table is the CPU's (on CUDA MLX's gather is slower than its ops)."""
    monkeypatch.setattr(gelu_table, "SETTING", None)
    with mx.stream(mx.cpu):
        assert gelu_table.wanted_here()
    if mx.is_available(mx.gpu):
        with mx.stream(mx.gpu):
            assert not gelu_table.wanted_here()
