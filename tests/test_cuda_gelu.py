"""The one-kernel GELU (``engine/cuda_gelu.py``): MLX's bits on every value, and a real
vision tower's features unchanged. They run only where MLX has its CUDA backend
(skipped elsewhere, CI included)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_vlm import load

from vlm_serve.engine import cuda_gelu
from vlm_serve.fixtures.build import cached_model
from vlm_serve.mlx_runtime import cuda_available

pytestmark = pytest.mark.skipif(not cuda_available(), reason="needs MLX's CUDA backend")


def test_the_kernel_gives_mlx_bits_on_every_bfloat16():
    """Every bfloat16 but NaNs, infinities included (NaN out where MLX gives NaN), and
    a tower-shaped activation."""
    assert cuda_gelu._checked()
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    nan = ((patterns & 0x7F80) == 0x7F80) & ((patterns & 0x7F) != 0)
    values = mx.array(patterns[~nan]).view(mx.bfloat16)  # 65,282 values: blocks of 2
    assert mx.array_equal(cuda_gelu._kernel_gelu(values), nn.gelu_approx(values), equal_nan=True).item()
    activation = (mx.random.normal((2, 256, 4304), key=mx.random.key(1)) * 3).astype(mx.bfloat16)
    assert mx.array_equal(cuda_gelu.gelu_approx(activation), nn.gelu_approx(activation)).item()


def test_a_view_and_an_odd_size_get_mlx_bits():
    """A transposed view (the kernel reads a contiguous copy) and a size with few
    factors of two (MLX's own ops)."""
    x = (mx.random.normal((64, 96), key=mx.random.key(2)) * 3).astype(mx.bfloat16)
    assert mx.array_equal(cuda_gelu.gelu_approx(x.T), nn.gelu_approx(x.T)).item()
    odd = x.reshape(-1)[: 63 * 97]
    assert mx.array_equal(cuda_gelu.gelu_approx(odd), nn.gelu_approx(odd)).item()


def test_a_vision_tower_gives_the_same_features_with_it():
    """Gemma 3's tower (the tiny fixture, in bfloat16) before and after ``install``."""
    model, _ = load(str(cached_model("gemma3")))
    model.set_dtype(mx.bfloat16)
    tower = model.vision_tower
    size = model.config.vision_config.image_size
    pixels = mx.random.normal((2, size, size, 3), key=mx.random.key(3)).astype(mx.bfloat16)
    before = tower(pixels, output_hidden_states=True)[0]
    assert cuda_gelu.install(model) > 0
    assert any(isinstance(m, cuda_gelu._KernelGELU) for _, m in tower.named_modules())
    assert mx.array_equal(tower(pixels, output_hidden_states=True)[0], before).item()

