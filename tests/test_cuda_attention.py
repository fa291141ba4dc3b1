"""The engine's CUDA attention kernels (``engine/decode/cuda_attention.py``), for decode
steps and for short prefill passes: close to MLX's own attention, and a row's output
the same to the bit batched as alone. They run only where MLX has its CUDA backend
(skipped elsewhere, CI included)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

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


@pytest.mark.parametrize("dim", [64, 80, 256])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_loads_in_flight_give_the_bits_of_one_load_at_a_time(dim, dtype, monkeypatch):
    """A lane's several loads in flight (``KEY_LOADS``, ``VALUE_LOADS``) give decode rows
    and a prefill pass's queries the bits of one load at a time."""
    assert cuda_attention.loads_in_flight(2, dim, dtype, 1) == (cuda_attention.KEY_LOADS, cuda_attention.VALUE_LOADS)
    monkeypatch.setattr(cuda_attention, "PIPELINE", 0)  # decode rows load into registers
    rng = np.random.default_rng(dim)
    counts = mx.array([1, 33, 255, 300, 700], mx.int32)
    q, keys, values = _store(rng, 5, 8, 4, dim, 768, dtype)
    pq, pk, pv = _pass(rng, 2, 8, 4, dim, 90, 30, dtype)
    outputs = []
    for loads in ((cuda_attention.KEY_LOADS, cuda_attention.VALUE_LOADS), (1, 1)):
        monkeypatch.setattr(cuda_attention, "KEY_LOADS", loads[0])
        monkeypatch.setattr(cuda_attention, "VALUE_LOADS", loads[1])
        decoded = cuda_attention.decode_attention(q, keys, values, counts, dim**-0.5)
        passed = cuda_attention.prefill_attention(pq, pk, pv, dim**-0.5, window=40, queries=1)
        outputs.append([np.array(out.astype(mx.float32)) for out in (decoded, passed)])
    assert np.array_equal(outputs[0][0], outputs[1][0]) and np.array_equal(outputs[0][1], outputs[1][1])


@pytest.mark.parametrize("kv_heads, dim", [(4, 80), (4, 256), (8, 128)])
def test_pipelined_decode_gives_the_bits_of_each_lane_loading_its_own(kv_heads, dim, monkeypatch):
    """Decode's keys and values copied into shared memory asynchronously, in pieces
    (``PIPELINE``), give each row the bits of each lane loading its own key and the
    values into registers (two query heads a block, and one)."""
    monkeypatch.setattr(cuda_attention, "PIPELINE", 5)
    assert cuda_attention.pipeline_stages(cuda_attention.heads_per_block(8, kv_heads, dim), dim, mx.bfloat16) == 5
    rng = np.random.default_rng(dim + 2)
    counts = mx.array([1, 33, 255, 300, 700], mx.int32)
    q, keys, values = _store(rng, 5, 8, kv_heads, dim, 768, mx.bfloat16)
    pipelined = cuda_attention.decode_attention(q, keys, values, counts, dim**-0.5)
    monkeypatch.setattr(cuda_attention, "PIPELINE", 0)
    own = cuda_attention.decode_attention(q, keys, values, counts, dim**-0.5)
    assert np.array_equal(np.array(pipelined.astype(mx.float32)), np.array(own.astype(mx.float32)))


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


def _pass(rng, prompts, heads, kv_heads, dim, columns, length, dtype):
    q = mx.array(rng.standard_normal((prompts, heads, length, dim)).astype(np.float32)).astype(dtype)
    _, keys, values = _store(rng, prompts, heads, kv_heads, dim, columns, dtype)
    return q, keys, values


def _prefill_reference(q, keys, values, scale, window):
    """MLX's attention with mlx-lm's causal mask for the last L of the keys' columns, on
    the CPU: on CUDA it composes matmuls, which MLX runs in TF32 for float32."""
    prompts, heads, length, dim = q.shape
    with mx.stream(mx.cpu):
        mask = create_causal_mask(length, keys.shape[2] - length, window_size=window)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(prompts * length, heads * dim)


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 256), (8, 1, 64), (16, 8, 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("columns, length, window", [
    (64, 64, None),  # a first pass: no cached keys
    (352, 64, None),  # a chat's next turn going on from 288 cached keys
    (300, 16, 32),  # a sliding window far behind
    (1100, 48, 1024),  # a window that just filled
    (40, 1, None),  # one query
    # Long passes take the kernel too where the engine keeps rows exact (row_exact):
    (512, 512, None),  # a long first pass
    (427, 300, 128),  # a pass longer than its window (127 cached keys kept, 300 new)
])
def test_prefill_matches_mlx_attention(heads, kv_heads, dim, dtype, columns, length, window):
    rng = np.random.default_rng(columns + length)
    q, keys, values = _pass(rng, 2, heads, kv_heads, dim, columns, length, dtype)
    scale = dim**-0.5
    ours = cuda_attention.prefill_attention(q, keys, values, scale, window)
    theirs = _prefill_reference(q, keys, values, scale, window)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(
        np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_prompt_in_a_shared_pass_equals_it_alone(dtype):
    """Prompts sharing a pass (one cached length, one padded length) never change each
    other's queries."""
    rng = np.random.default_rng(1)
    q, keys, values = _pass(rng, 3, 8, 4, 256, 330, 32, dtype)
    together = np.array(cuda_attention.prefill_attention(q, keys, values, 1 / 16).astype(mx.float32))
    for i in range(3):
        alone = cuda_attention.prefill_attention(q[i:i + 1], keys[i:i + 1], values[i:i + 1], 1 / 16)
        assert np.array_equal(np.array(alone.astype(mx.float32)), together[32 * i:32 * (i + 1)]), f"prompt {i}"


def _visible(rng, prompts, length, columns):
    """Random boolean masks (prompts, L, columns), each query seeing its own column."""
    mask = rng.random((prompts, length, columns)) < 0.6
    mask[:, np.arange(length), columns - length + np.arange(length)] = True
    return mx.array(mask)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("columns, length", [(64, 64), (700, 40), (300, 1)])
def test_masked_prefill_matches_mlx_attention(dtype, columns, length):
    rng = np.random.default_rng(columns)
    q, keys, values = _pass(rng, 2, 8, 2, 128, columns, length, dtype)
    mask = _visible(rng, 2, length, columns)
    ours = cuda_attention.prefill_attention(q, keys, values, 0.1, causal=False, mask=mask)
    with mx.stream(mx.cpu):
        theirs = cuda_attention.reference_prefill_attention(q, keys, values, 0.1, causal=False, mask=mask)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    np.testing.assert_allclose(
        np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)), atol=tol, rtol=tol
    )


@pytest.mark.parametrize("window", [None, 100])
def test_a_query_gets_the_same_bits_however_its_keys_are_given(window):
    """A causal count, a window, or the same columns as a mask (mlx-vlm gives each,
    depending on the pass): one arithmetic."""
    rng = np.random.default_rng(2)
    columns, length = 520, 300
    q, keys, values = _pass(rng, 1, 8, 4, 256, columns, length, mx.bfloat16)
    own = np.arange(columns - length, columns)[:, None]
    mask = np.arange(columns)[None, :] <= own
    if window:
        mask &= np.arange(columns)[None, :] > own - window
    counted = cuda_attention.prefill_attention(q, keys, values, 1 / 16, window)
    masked = cuda_attention.prefill_attention(q, keys, values, 1 / 16, causal=False,
                                              mask=mx.array(mask[None]))
    assert np.array_equal(np.array(counted.astype(mx.float32)), np.array(masked.astype(mx.float32)))


def test_a_masked_prompt_in_a_shared_padded_pass_equals_it_alone():
    """Prompts padded to one pass with masks of their own (padding rows see nothing)."""
    rng = np.random.default_rng(3)
    lengths, columns = [40, 17, 33], 40
    q, keys, values = _pass(rng, 3, 8, 4, 128, columns, columns, mx.bfloat16)
    mask = np.asarray(_visible(rng, 3, columns, columns))
    for i, n in enumerate(lengths):
        mask[i, n:] = False  # padding queries
        mask[i, :, n:] = False  # padding keys
    together = np.array(cuda_attention.prefill_attention(
        q, keys, values, 1 / 16, causal=False, mask=mx.array(mask)).astype(mx.float32))
    assert np.all(np.isfinite(together))
    for i, n in enumerate(lengths):
        alone = cuda_attention.prefill_attention(
            q[i:i + 1, :, :n], keys[i:i + 1, :, :n], values[i:i + 1, :, :n], 1 / 16, causal=False,
            mask=mx.array(mask[i:i + 1, :n, :n]))
        assert np.array_equal(np.array(alone.astype(mx.float32)),
                              together[columns * i:columns * i + n]), f"prompt {i}"


@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 256), (28, 4, 128), (32, 16, 512)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_queries_sharing_a_block_compute_what_each_computes_alone(heads, kv_heads, dim, dtype):
    """A block of pass 1 loads each key and value once for several queries of a prompt:
    every number of them gives each query the same bits as a block of its own, with a
    count, a window or a mask, and where the last block runs past the pass's end."""
    rng = np.random.default_rng(heads + dim + 1)
    columns, length = 400, 37
    q, keys, values = _pass(rng, 2, heads, kv_heads, dim, columns, length, dtype)
    mask = _visible(rng, 2, length, columns)
    group = cuda_attention.heads_per_block(heads, kv_heads, dim)
    most = cuda_attention.queries_in_shared_memory(group, dim)
    for kwargs in ({}, {"window": 64}, {"causal": False, "mask": mask}):
        alone = cuda_attention.prefill_attention(q, keys, values, dim**-0.5, queries=1, **kwargs)
        for queries in [n for n in (2, 4, 8) if n <= most]:
            shared = cuda_attention.prefill_attention(q, keys, values, dim**-0.5, queries=queries, **kwargs)
            assert mx.array_equal(shared, alone).item(), f"{queries} queries a block, {kwargs.keys()}"


# -- the tensor-core prefill kernel (cuda_attention.FLASH_PREFILL) ----------------------


# Columns per block: all of them, or chunks of 256 met by a second pass (FLASH_CHUNK).
FLASH_CHUNKS = [0, 256]


@pytest.mark.parametrize("chunk", FLASH_CHUNKS)
@pytest.mark.parametrize("heads, kv_heads, dim", [(8, 4, 256), (28, 4, 128), (8, 1, 64), (8, 2, 512)])
@pytest.mark.parametrize("columns, length, window", [(64, 64, None), (352, 64, None), (427, 300, 128),
                                                     (40, 1, None), (700, 100, None)])
def test_flash_prefill_matches_mlx_attention(heads, kv_heads, dim, columns, length, window, chunk):
    rng = np.random.default_rng(columns + length + dim)
    q, keys, values = _pass(rng, 2, heads, kv_heads, dim, columns, length, mx.bfloat16)
    ours = cuda_attention.flash_prefill_attention(q, keys, values, dim**-0.5, window, chunk=chunk)
    theirs = _prefill_reference(q, keys, values, dim**-0.5, window)
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)),
                               atol=2e-2, rtol=2e-2)
    mask = _visible(rng, 2, length, columns)
    ours = cuda_attention.flash_prefill_attention(q, keys, values, dim**-0.5, causal=False, mask=mask,
                                                  chunk=chunk)
    with mx.stream(mx.cpu):
        theirs = cuda_attention.reference_prefill_attention(q, keys, values, dim**-0.5, causal=False,
                                                            mask=mask)
    np.testing.assert_allclose(np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32)),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dim", [256, 512])  # past 256, two warps share a query's sums
@pytest.mark.parametrize("chunk", FLASH_CHUNKS)
@pytest.mark.parametrize("window", [None, 100])
def test_flash_prefill_gives_a_query_the_same_bits_in_any_pass(window, chunk, dim):
    """Alone or padded beside other prompts, as a count or as a mask, and from a cache
    (the same prompt's last queries in a pass of their own, as after a prefix-cache hit)."""
    rng = np.random.default_rng(5)
    columns, length = 520, 300
    q, keys, values = _pass(rng, 3, 8, 4, dim, columns, length, mx.bfloat16)

    def flash(*args, **kwargs):
        return cuda_attention.flash_prefill_attention(*args, **kwargs, chunk=chunk)

    together = flash(q, keys, values, 1 / 16, window)
    for i in range(3):
        alone = flash(q[i:i + 1], keys[i:i + 1], values[i:i + 1], 1 / 16, window)
        assert mx.array_equal(alone, together[length * i:length * (i + 1)]).item(), f"prompt {i}"
    own = np.arange(columns - length, columns)[:, None]
    mask = np.arange(columns)[None, :] <= own
    if window:
        mask &= np.arange(columns)[None, :] > own - window
    masked = flash(q, keys, values, 1 / 16, causal=False, mask=mx.array(mask[None]))
    assert mx.array_equal(masked, together).item()
    # The last 37 queries of prompt 0 alone, on the keys up to the last one's.
    tail = flash(q[:1, :, -37:], keys[:1], values[:1], 1 / 16, window)
    assert mx.array_equal(tail, together[length - 37:length]).item()


@pytest.mark.parametrize("kernel", ["per-query float32", "per-query", "tensor-core", "tensor-core in chunks",
                                    "tensor-core, 512 dims"])
def test_prefill_groups_keys_by_position(kernel):
    """A sliding window's cache keeps the last keys of wherever its previous pass ended
    (a prefix-cache hit or another request's pass moves where that is): given where its
    keys start, a query gets the bits of the whole prompt's pass."""
    dtype = mx.float32 if "float32" in kernel else mx.bfloat16
    dim = 512 if "512" in kernel else 128
    extra = {"queries": 1} if "per-query" in kernel else {"chunk": 256 if "chunks" in kernel else 0}
    attend = cuda_attention.prefill_attention if "per-query" in kernel else cuda_attention.flash_prefill_attention
    rng = np.random.default_rng(11)
    columns, length, window = 1100, 300, 512
    q, keys, values = _pass(rng, 2, 8, 4, dim, columns, length, dtype)
    whole = attend(q, keys, values, dim**-0.5, window, **extra)
    for drop in (6, 100, 255, 288):  # the first keys a query still sees: column 288
        kept = attend(q, keys[:, :, drop:], values[:, :, drop:], dim**-0.5, window, origin=drop, **extra)
        assert mx.array_equal(kept, whole).item(), f"keys from {drop}"
