"""The engine's fused residual add and RMSNorms (``engine/decode/cuda_norms.py``): close to
MLX's three ops, and a row's result the same to the bit batched as alone. They run only
where MLX has its CUDA backend (skipped elsewhere, CI included)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine.decode import cuda_norms

pytestmark = pytest.mark.skipif(not cuda_norms.available(), reason="needs MLX's CUDA backend")

EPS = 1e-6


def _inputs(rows: int, hidden: int, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return mx.array((scale * rng.standard_normal(shape)).astype(np.float32)).astype(dtype)

    return normal(rows, hidden, scale=4.0), normal(rows, hidden), 1.0 + normal(hidden, scale=0.1), \
        1.0 + normal(hidden, scale=0.1)


@pytest.mark.parametrize("hidden", [640, 1152, 2560, 3840])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_matches_mlx_ops(hidden, dtype):
    x, r, w_after, w_next = _inputs(7, hidden, dtype, hidden)
    h, n = cuda_norms.fused_add_norm(x, r, w_after, w_next, EPS)
    h_mlx = x + mx.fast.rms_norm(r, w_after, EPS)
    n_mlx = mx.fast.rms_norm(h_mlx, w_next, EPS)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    for ours, theirs in ((h, h_mlx), (n, n_mlx)):
        assert ours.dtype == dtype and ours.shape == theirs.shape
        np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_row_gets_the_same_bits_batched_as_alone(dtype):
    x, r, w_after, w_next = _inputs(64, 2560, dtype)
    h, n = cuda_norms.fused_add_norm(x, r, w_after, w_next, EPS)
    for row in (0, 17, 63):
        h1, n1 = cuda_norms.fused_add_norm(x[row:row + 1], r[row:row + 1], w_after, w_next, EPS)
        assert mx.array_equal(h1[0], h[row]).item() and mx.array_equal(n1[0], n[row]).item()


@pytest.mark.parametrize("hidden", [1000, 2560])  # a tail past the block's threads, and none
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_both_forms_give_the_same_bits(hidden, dtype, monkeypatch):
    """The form that keeps a row's elements in registers against the one that reads
    them again each pass, as the GPU's compiler builds them."""
    x, r, w_after, w_next = _inputs(64, hidden, dtype, hidden)
    results = []
    for form in cuda_norms.FORMS:
        monkeypatch.setattr(cuda_norms, "FORM", form)
        results.append(cuda_norms.fused_add_norm(x, r, w_after, w_next, EPS))
    (h, n), (h2, n2) = results
    assert mx.array_equal(h, h2).item() and mx.array_equal(n, n2).item()
