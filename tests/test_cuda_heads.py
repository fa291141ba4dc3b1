"""The engine's attention-heads kernel (``engine/decode/cuda_heads.py``): close to MLX's
split, RMSNorms and RoPE in a decode step and in a prefill pass, and a row's result the
same to the bit batched as alone. They run only where MLX has its CUDA backend (skipped
elsewhere, CI included)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from vlm_serve.engine.decode import cuda_heads

pytestmark = pytest.mark.skipif(not cuda_heads.available(), reason="needs MLX's CUDA backend")

HEADS, KV_HEADS, DIM = 8, 4, 256  # Gemma 3 4B's


def _heads(dtype, base: float, scale: float, seed: int = 0):
    rng = np.random.default_rng(seed)

    def normal(*shape, std=1.0):
        return mx.array((std * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    heads = cuda_heads.AttentionHeads(HEADS, KV_HEADS, DIM, 1.0 + normal(DIM, std=0.1), 1.0 + normal(DIM, std=0.1),
                                      1e-6, nn.RoPE(DIM, base=base, scale=scale))
    return heads, normal(64, (HEADS + 2 * KV_HEADS) * DIM, std=3.0)


@pytest.mark.parametrize("base, scale", [(10_000.0, 1.0), (1_000_000.0, 0.125)])  # local and global layers
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_matches_mlx_ops(dtype, base, scale):
    heads, qkv = _heads(dtype, base, scale)
    positions = mx.array(np.arange(64) * 997 % 40_000, mx.int32)
    assert cuda_heads.fits(heads.rope, DIM, dtype)
    ours = heads.fused(qkv, positions)
    B = qkv.shape[0]
    q, k, v = mx.split(qkv, heads.split, axis=-1)
    q = heads.rope(mx.fast.rms_norm(q.reshape(B, HEADS, 1, -1), heads.q_norm, heads.eps), offset=positions)
    k = heads.rope(mx.fast.rms_norm(k.reshape(B, KV_HEADS, 1, -1), heads.k_norm, heads.eps), offset=positions)
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    for got, want in zip(ours, (q, k, v.reshape(B, KV_HEADS, 1, -1))):
        assert got.dtype == dtype and got.shape == want.shape
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_row_gets_the_same_bits_batched_as_alone(dtype):
    heads, qkv = _heads(dtype, 1_000_000.0, 0.125)
    positions = mx.array(np.arange(64) * 31, mx.int32)
    batched = heads.fused(qkv, positions)
    for row in (0, 17, 63):
        alone = heads.fused(qkv[row:row + 1], positions[row:row + 1])
        assert all(mx.array_equal(a[0], b[row]).item() for a, b in zip(alone, batched))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_pass_matches_mlx_ops_and_a_row_alone(dtype):
    """Four rows of 16 tokens from position 100: as the prefill's MLX ops (transposed
    views, RoPE from the offset), and each row's bits the same alone."""
    heads, qkv = _heads(dtype, 10_000.0, 1.0)
    B, L = 4, 16
    starts = mx.full((B,), 100, mx.int32)
    ours = heads.fused(qkv, starts, L)
    q, k, v = mx.split(qkv, heads.split, axis=-1)
    q = mx.fast.rms_norm(q.reshape(B, L, HEADS, -1).transpose(0, 2, 1, 3), heads.q_norm, heads.eps)
    k = mx.fast.rms_norm(k.reshape(B, L, KV_HEADS, -1).transpose(0, 2, 1, 3), heads.k_norm, heads.eps)
    want = (heads.rope(q, offset=100), heads.rope(k, offset=100), v.reshape(B, L, KV_HEADS, -1).transpose(0, 2, 1, 3))
    tol = 1e-4 if dtype == mx.float32 else 3e-2
    for got, expected in zip(ours, want):
        assert got.shape == expected.shape
        np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(expected.astype(mx.float32)),
                                   atol=tol, rtol=tol)
    for row in (0, 3):
        alone = heads.fused(qkv[row * L:(row + 1) * L], starts[row:row + 1], L)
        assert all(mx.array_equal(a[0], b[row]).item() for a, b in zip(alone, ours))
