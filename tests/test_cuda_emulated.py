"""The engine's CUDA kernels on a CPU emulation of CUDA (``kernel_emulation.py``): what a
kernel's structure promises, checked without a GPU. A row's bits must not depend on
what shares its batch, and a variant that claims to add the same terms in the same
order as the default kernel must give its bits. The emulation runs the kernels' own
source strings. Its mma adds in an order of its own, so these checks say which operands
meet in which order, not what the hardware rounds; ``tests/test_cuda_matmul.py`` and
``tests/test_cuda_attention.py`` check that on a GPU. Needs g++ and the CUDA toolkit's
headers, and ``VLM_SERVE_SLOW_TESTS=1``: a few hundred emulated threads take 2-3 minutes
on two cores (skipped otherwise, CI included). Run it after changing a kernel:

    VLM_SERVE_SLOW_TESTS=1 python -m pytest -q tests/test_cuda_emulated.py
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import kernel_emulation as emulation
from vlm_serve.engine.decode import cuda_norms

pytestmark = [
    pytest.mark.skipif(not emulation.available(), reason="needs g++ and the CUDA toolkit's headers"),
    pytest.mark.skipif(not os.environ.get("VLM_SERVE_SLOW_TESTS"), reason="VLM_SERVE_SLOW_TESTS=1"),
]


def _bf16(rng, *shape, scale: float = 1.0) -> np.ndarray:
    return emulation.to_bf16(rng.standard_normal(shape) * scale)


@pytest.mark.parametrize("width, out", [(640, 72), (4096, 40)])  # four warps, eight
def test_matmul_variants_give_the_default_kernels_bits(width, out):
    """Every tile count, with and without rows loaded ahead, and with a column tile's row
    blocks first in the grid: the same bits, for a batch and for each row alone, and
    close to float64."""
    matmul = emulation.Matmul(width, out)
    rng = np.random.default_rng(width)
    w, bias = _bf16(rng, out, width, scale=width**-0.5), _bf16(rng, out)
    for rows in (7, 40):
        x = _bf16(rng, rows, width)
        default = matmul(x, w, bias, tiles=next(t for t in (1, 2, 4, 8) if rows <= 16 * t))
        exact = emulation.from_bf16(x).astype(np.float64) @ emulation.from_bf16(w).astype(np.float64).T
        np.testing.assert_allclose(emulation.from_bf16(default), exact + emulation.from_bf16(bias),
                                   atol=3e-2, rtol=2e-2)
        for tiles in (1, 2, 4, 8):
            assert np.array_equal(matmul(x, w, bias, tiles), default), f"{tiles} tiles"
        for tiles in (1, 2):
            assert np.array_equal(matmul(x, w, bias, tiles, ahead=True), default), f"ahead, {tiles} tiles"
            assert np.array_equal(matmul(x, w, bias, tiles, ahead=True, rows_first=True), default), \
                f"row blocks first, {tiles} tiles"
        for i in (0, rows - 1):
            assert np.array_equal(matmul(x[i:i + 1], w, bias, 1)[0], default[i]), f"row {i} alone"


def test_quantized_matmul_variants_give_the_default_kernels_bits():
    """4-bit weights (MLX's affine format): every tile count, rows loaded ahead and row
    blocks first, the default's bits, batched and alone, and close to the dequantized
    weights' product."""
    width, out, bits, group = 640, 72, 4, 64
    matmul = emulation.Matmul(width, out, bits, group)
    rng = np.random.default_rng(4)
    packed, scales, biases, dequantized = emulation.quantize(rng.standard_normal((out, width)) / width**0.5,
                                                             bits, group)
    bias = _bf16(rng, out)
    weights = dict(scales=scales, biases=biases)
    x = _bf16(rng, 40, width)
    default = matmul(x, packed, bias, tiles=4, **weights)
    exact = emulation.from_bf16(x).astype(np.float64) @ dequantized.T + emulation.from_bf16(bias)
    np.testing.assert_allclose(emulation.from_bf16(default), exact, atol=5e-2, rtol=3e-2)
    for tiles in (1, 2, 4, 8):
        assert np.array_equal(matmul(x, packed, bias, tiles, **weights), default), f"{tiles} tiles"
    for tiles in (1, 2):
        assert np.array_equal(matmul(x, packed, bias, tiles, ahead=True, **weights), default), f"ahead, {tiles}"
        assert np.array_equal(matmul(x, packed, bias, tiles, ahead=True, rows_first=True, **weights),
                              default), f"row blocks first, {tiles}"
    assert np.array_equal(matmul(x[5:6], packed, bias, 1, **weights)[0], default[5]), "a row alone"


@pytest.fixture(scope="module")
def attention():
    return emulation.Attention()


@pytest.fixture(scope="module")
def chunked_attention():
    return emulation.Attention(flash_chunk=64)  # the tensor-core kernel, 64 columns a block


@pytest.fixture(scope="module")
def wide_attention():
    return emulation.Attention(heads=2, kv_heads=1, dim=512)  # two warps share a query's sums


def _pass(rng, attention, prompts: int, length: int, columns: int):
    return (_bf16(rng, prompts, attention.heads, length, attention.dim),
            _bf16(rng, prompts, attention.kv_heads, columns, attention.dim),
            _bf16(rng, prompts, attention.kv_heads, columns, attention.dim))


KERNELS = {"per-query": "attention", "tensor-core": "attention", "tensor-core in chunks": "chunked_attention",
           "tensor-core, 512 dims": "wide_attention"}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_prefill_attention_gives_a_query_the_same_bits_in_any_pass(request, kernel):
    """Close to float64; with 1, 2 or 4 queries a block (the per-query kernel); alone or
    beside other prompts; given its keys as a count, a window or a mask; beside columns
    it does not see (a longer prompt's, in a padded pass); and from a cache (its
    prompt's last queries in a pass of their own)."""
    attention = request.getfixturevalue(KERNELS[kernel])
    tensor_cores = kernel != "per-query"
    rng = np.random.default_rng(len(kernel))
    length, columns = 12, 200
    q, k, v = _pass(rng, attention, 2, length, columns)
    mask = rng.random((2, length, columns)) < 0.6
    mask[:, np.arange(length), columns - length + np.arange(length)] = True

    def run(q, k, v, **kwargs):
        return attention.prefill(q, k, v, tensor_cores=tensor_cores, **kwargs)

    # 90 more columns no query sees: other keys, never looked at.
    _, k_more, v_more = _pass(rng, attention, 2, 0, 90)
    padded = run(q, np.concatenate([k, k_more], 2), np.concatenate([v, v_more], 2), causal=False,
                 mask=np.concatenate([mask, np.zeros((2, length, 90), bool)], 2))
    assert np.array_equal(padded, run(q, k, v, causal=False, mask=mask)), "beside unseen columns"

    for kwargs in ({}, {"window": 48}, {"causal": False, "mask": mask}):
        together = run(q, k, v, **kwargs)
        np.testing.assert_allclose(emulation.from_bf16(together), attention.reference(q, k, v, **kwargs),
                                   atol=2e-2, rtol=2e-2)
        if not tensor_cores:
            for queries in (2, 4):
                assert np.array_equal(run(q, k, v, queries=queries, **kwargs), together), f"{queries} a block"
        for i in range(2):
            alone = run(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                        **{**kwargs, **({"mask": mask[i:i + 1]} if "mask" in kwargs else {})})
            assert np.array_equal(alone, together[length * i:length * (i + 1)]), f"prompt {i} alone"
    for window in (0, 48):
        counted = run(q, k, v, window=window)
        masked = run(q, k, v, causal=False, mask=emulation.causal_mask(length, columns, window))
        assert np.array_equal(masked, counted), f"window {window}: a count and a mask"
        tail = run(q[:1, :, -5:], k[:1], v[:1], window=window)
        assert np.array_equal(tail, counted[length - 5:length]), f"window {window}: from a cache"


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_prefill_attention_groups_keys_by_position(request, kernel):
    """A sliding window's cache keeps the last keys of wherever its previous pass ended:
    given where its keys start, a query gets the bits of the whole prompt's pass."""
    attention = request.getfixturevalue(KERNELS[kernel])
    tensor_cores = kernel != "per-query"
    rng = np.random.default_rng(7)
    length, columns, window = 12, 200, 48
    q, k, v = _pass(rng, attention, 2, length, columns)
    mask = emulation.causal_mask(length, columns, window)
    whole = attention.prefill(q, k, v, window=window, tensor_cores=tensor_cores)
    masked = attention.prefill(q, k, v, causal=False, mask=mask, tensor_cores=tensor_cores)
    for drop in (5, 37, 100, columns - length - window + 1):  # the first keys a query still sees
        kept = attention.prefill(q, k[:, :, drop:], v[:, :, drop:], window=window, origin=drop,
                                 tensor_cores=tensor_cores)
        assert np.array_equal(kept, whole), f"keys from {drop}"
        kept = attention.prefill(q, k[:, :, drop:], v[:, :, drop:], causal=False, mask=mask[:, :, drop:],
                                 origin=drop, tensor_cores=tensor_cores)
        assert np.array_equal(kept, masked), f"keys from {drop}, masked"


def test_decode_attention_takes_each_rows_own_keys(attention):
    rng = np.random.default_rng(2)
    counts = np.array([1, 40, 257, 300], np.int32)
    q, k, v = _pass(rng, attention, len(counts), 1, 300)
    out = attention.decode(q, k, v, counts)
    expected = np.concatenate([attention.reference(q[i:i + 1], k[i:i + 1, :, :n], v[i:i + 1, :, :n], causal=False)
                               for i, n in enumerate(counts)])
    np.testing.assert_allclose(emulation.from_bf16(out), expected, atol=2e-2, rtol=2e-2)
    alone = attention.decode(q[2:3], k[2:3, :, :288], v[2:3, :, :288], counts[2:3])  # fewer columns
    assert np.array_equal(alone, out[2:3])


@pytest.mark.parametrize("dim", [80, 256])
def test_loads_in_flight_give_the_bits_of_one_load_at_a_time(dim):
    """A lane's several loads in flight (runs of its key, columns' values) give decode
    rows the bits of one load at a time: rows whose counts end inside a group of loads,
    a round of 32 columns and a chunk, and a row of one key (at 80 dims a key's runs
    do not fill the last group); and the queries of a prefill pass, two a block."""
    one = emulation.Attention(heads=4, kv_heads=2, dim=dim, loads=(1, 1), pipeline=0)
    several = emulation.Attention(heads=4, kv_heads=2, dim=dim, pipeline=0)
    rng = np.random.default_rng(dim)
    counts = np.array([1, 45, 258, 300], np.int32)
    q, k, v = _pass(rng, several, len(counts), 1, 300)
    assert np.array_equal(several.decode(q, k, v, counts), one.decode(q, k, v, counts))
    q, k, v = _pass(rng, several, 2, 20, 70)
    assert np.array_equal(several.prefill(q, k, v, window=48, queries=2), one.prefill(q, k, v, window=48, queries=2))


@pytest.mark.parametrize("kv_heads, dim", [(2, 64), (2, 80), (2, 256), (4, 128)])
def test_pipelined_decode_gives_the_bits_of_each_lane_loading_its_own(kv_heads, dim):
    """Decode's keys and values through shared memory by asynchronous copies, in pieces
    (``PIPELINE`` stages), give each row the bits of each lane loading its own key and
    the values into registers: rows whose counts end inside a piece, a round of 32
    columns and a chunk, and a row of one key; two stages and five; two query heads a
    block and one."""
    own = emulation.Attention(heads=4, kv_heads=kv_heads, dim=dim, pipeline=0)
    rng = np.random.default_rng(dim + 1)
    counts = np.array([1, 45, 258, 300], np.int32)
    q, k, v = _pass(rng, own, len(counts), 1, 300)
    expected = own.decode(q, k, v, counts)
    for stages in (2, 5):
        pipelined = emulation.Attention(heads=4, kv_heads=kv_heads, dim=dim, pipeline=stages)
        assert np.array_equal(pipelined.decode(q, k, v, counts), expected), f"{stages} stages"


def test_attention_heads_are_normed_and_rotated_alike_in_steps_and_passes():
    """Query and key heads RMS-normalized and rotated at each token's position (Gemma 3's
    local and global rotary settings), value heads as they are: close to float64, in a
    decode step (one token a row) and in a pass (several); a row's bits the same alone
    as in its batch, and a token's the same in a step as in a pass."""
    rng = np.random.default_rng(3)
    heads, kv_heads, dim = 4, 2, 64
    for base, scale in ((10_000.0, 1.0), (1_000_000.0, 0.125)):
        kernel = emulation.Heads(heads, kv_heads, dim, 1e-6, base, scale)
        q_norm, k_norm = (emulation.to_bf16(1.0 + 0.1 * rng.standard_normal(dim)) for _ in range(2))
        starts = np.array([0, 7, 300, 4095, 131_000], np.int32)
        for length in (1, 3):
            qkv = _bf16(rng, len(starts) * length, (heads + 2 * kv_heads) * dim, scale=3.0)
            got = kernel(qkv, q_norm, k_norm, starts)
            want = kernel.reference(qkv, q_norm, k_norm, starts)
            for ours, exact in zip(got[:2], want[:2]):
                np.testing.assert_allclose(emulation.from_bf16(ours), exact, atol=3e-2, rtol=2e-2)
            assert np.array_equal(emulation.from_bf16(got[2]), want[2])
            for row in (0, 4):
                alone = kernel(qkv[row * length:(row + 1) * length], q_norm, k_norm, starts[row:row + 1])
                assert all(np.array_equal(a[0], b[row]) for a, b in zip(alone, got)), f"row {row} alone"
            if length > 1:  # the pass's last token of row 2, as a step at its position
                token = 2 * length + length - 1
                step = kernel(qkv[token:token + 1], q_norm, k_norm, starts[2:3] + length - 1)
                assert all(np.array_equal(a[0, :, 0], b[2, :, -1]) for a, b in zip(step, got)), "step vs pass"


def test_add_norm_forms_give_the_same_bits():
    """Keeping a thread's elements in registers changes where they are read from, not
    which sums the kernel adds in which order."""
    rng = np.random.default_rng(5)
    for hidden in (640, 1000):  # whole rounds of the block's threads, and a tail
        x, r = _bf16(rng, 3, hidden, scale=4.0), _bf16(rng, 3, hidden)
        w_after, w_next = (emulation.to_bf16(1.0 + 0.1 * rng.standard_normal(hidden)) for _ in range(2))
        passes, registers = (emulation.AddNorm(hidden, 1e-6, form)(x, r, w_after, w_next)
                             for form in ("passes", "registers"))
        assert all(np.array_equal(a, b) for a, b in zip(passes, registers)), f"hidden {hidden}"


@pytest.mark.parametrize("form", cuda_norms.FORMS)
def test_add_norm_is_close_and_gives_a_row_alone_its_bits(form):
    """The residual add between two RMSNorms, a row per block (a decode step's rows or a
    pass's tokens): close to float64, and a row's bits the same alone as among others."""
    rng = np.random.default_rng(4)
    hidden = 640
    kernel = emulation.AddNorm(hidden, 1e-6, form)
    x, r = _bf16(rng, 6, hidden, scale=4.0), _bf16(rng, 6, hidden)
    w_after, w_next = (emulation.to_bf16(1.0 + 0.1 * rng.standard_normal(hidden)) for _ in range(2))
    h, n = kernel(x, r, w_after, w_next)
    want_h, want_n = kernel.reference(x, r, w_after, w_next)
    np.testing.assert_allclose(emulation.from_bf16(h), want_h, atol=5e-2, rtol=2e-2)
    np.testing.assert_allclose(emulation.from_bf16(n), want_n, atol=5e-2, rtol=2e-2)
    for row in (0, 5):
        alone = kernel(x[row:row + 1], r[row:row + 1], w_after, w_next)
        assert np.array_equal(alone[0][0], h[row]) and np.array_equal(alone[1][0], n[row]), f"row {row} alone"
