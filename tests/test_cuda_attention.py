"""The engine's CUDA decode-attention kernels (``engine/decode/cuda_attention.py``):
close to MLX's own attention, and a row's output the same to the bit batched as alone.
They run only where MLX has its CUDA backend (skipped elsewhere, CI included)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine.decode import cuda_attention

pytestmark = pytest.mark.skipif(not cuda_attention.available(), reason="needs MLX's CUDA backend")


def _store(rng, rows, heads, kv_heads, dim, columns, dtype):
    q = mx.array(rng.standard_normal((rows, heads, 1, dim)).astype(np.float32)).astype(dtype)
    keys = mx.array(rng.standard_normal((rows, kv_heads, columns, dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((rows, kv_heads, columns, dim)).astype(np.float32))
    return q, keys.astype(dtype), values.astype(dtype)


@pytest.mark.parametrize("dim", [16, 64, 128, 256, 512])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_matches_mlx_attention(dim, dtype):
    rng = np.random.default_rng(dim)
    heads, kv_heads, columns = 8, 2, 768
    counts = [1, 5, 255, 256, 257, 600, 700, 33]
    q, keys, values = _store(rng, len(counts), heads, kv_heads, dim, columns, dtype)
    counts = mx.array(counts, mx.int32)
    scale = dim**-0.5
    ours = cuda_attention.decode_attention(q, keys, values, counts, scale)
    theirs = cuda_attention.reference_attention(q, keys, values, counts, scale)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(
        np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_row_batched_equals_it_alone(dtype):
    """Other rows, and more columns (more chunks) never change a row."""
    rng = np.random.default_rng(0)
    heads, kv_heads, dim, columns = 8, 4, 256, 1024
    counts = [3, 300, 900, 512, 64]
    q, keys, values = _store(rng, len(counts), heads, kv_heads, dim, columns, dtype)
    together = cuda_attention.decode_attention(q, keys, values, mx.array(counts, mx.int32), 1 / 16)
    for i, count in enumerate(counts):
        own = -(-count // 32) * 32
        alone = cuda_attention.decode_attention(
            q[i:i + 1], keys[i:i + 1, :, :own], values[i:i + 1, :, :own],
            mx.array([count], mx.int32), 1 / 16,
        )
        assert np.array_equal(np.array(alone.astype(mx.float32)),
                              np.array(together[i:i + 1].astype(mx.float32))), f"row {i}"


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 256), (8, 1, 64), (28, 4, 128), (32, 16, 512)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_heads_sharing_a_block_compute_what_each_computes_alone(heads, kv_heads, dim, dtype):
    """A block of pass 1 loads each key and value once for the query heads that share
    them: every way of grouping those heads gives the same bits as one head per block."""
    rng = np.random.default_rng(heads + dim)
    counts = mx.array([1, 40, 255, 257, 700], mx.int32)
    q, keys, values = _store(rng, 5, heads, kv_heads, dim, 768, dtype)
    one = np.array(cuda_attention.decode_attention(q, keys, values, counts, dim**-0.5, group=1).astype(mx.float32))
    shared = heads // kv_heads
    for group in [g for g in range(2, shared + 1) if shared % g == 0 and g * dim <= cuda_attention.GROUP_FLOATS]:
        grouped = cuda_attention.decode_attention(q, keys, values, counts, dim**-0.5, group=group)
        assert np.array_equal(np.array(grouped.astype(mx.float32)), one), f"{group} heads per block"
