"""Gemma 3's prefill passes run on the engine decoder's fused weights
(``Gemma3Decoder.prefill``): the last position's logits equal those of mlx-vlm's model
code, run on a separately loaded copy of the model whose weights were never fused, to
the bit on the CPU. This holds for a prompt in one pass and in two, below and past the
sliding window, in float32 and in 4-bit, and for a pass that stacks two prompts. On
CUDA, passes take the engine's own attention and heads kernels, which round otherwise
than MLX's composed attention and its norms: there they agree within float32 rounding.

The token ids stay inside the tiny fixture's vocabulary: ids past it read outside the
embedding table, which gives garbage that changes from run to run.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_vlm import load as vlm_load

from vlm_serve.engine.decode import cuda_heads, cuda_norms
from vlm_serve.engine.decode.attention import uses_kernels
from vlm_serve.engine.families import family_for
from vlm_serve.engine.prefill import prefill_pass
from vlm_serve.fixtures.build import cached_model

from oracle import skip_where_refused


class _ModelCode:
    """Runs every prefill pass through the model code."""

    def prefill_decoder(self, kwargs):
        return None


def _passes(model, family, ids: mx.array, chunks: list[int]) -> mx.array:
    """The last logits of ``ids`` prefilled in passes of ``chunks`` tokens."""
    lm = model.language_model
    cache, start = lm.make_cache(), 0
    for i, n in enumerate(chunks):
        # Embedded per pass, as the engine does: the model code scales its input in place.
        embeds = lm.model.embed_tokens(ids[:, start:start + n])
        last = i == len(chunks) - 1
        out = prefill_pass(model, family, ids[:, start:start + n], embeds, cache, {},
                           None if last else n)
        mx.eval([c.state for c in cache])
        start += n
    return out[0]


def _agree(got: mx.array, expected: mx.array) -> bool:
    if uses_kernels():  # within 3% of the logits' range, and the same top token
        # (the model code's float32 matmuls run in TF32 on CUDA: 1.2% seen on an H200)
        spread = mx.abs(expected).max().item()
        return (mx.abs(got - expected).max().item() <= 0.03 * spread
                and mx.array_equal(got.argmax(-1), expected.argmax(-1)).item())
    return mx.array_equal(got, expected).item()


@pytest.mark.parametrize("bits", [None, 4])
def test_prefill_on_fused_weights_equals_the_model_code(bits):
    path = cached_model("gemma3", bits=bits)
    skip_where_refused(str(path))
    reference, _ = vlm_load(str(path))
    model, _ = vlm_load(str(path))
    family = family_for(model)
    assert family.prefill_decoder({}) is not None  # fuses the weights in place
    vocab = reference.language_model.model.embed_tokens.weight.shape[0]
    window = reference.language_model.model.window_size
    for length, chunks in ((20, [20]), (64, [64]), (64, [30, 34]), (3 * window, [window, 2 * window])):
        ids = mx.random.randint(3, vocab, (2, length), key=mx.random.key(length))
        for rows in (ids[:1], ids):  # one prompt, and two stacked in one pass
            expected = _passes(reference, _ModelCode(), rows, chunks)
            got = _passes(model, family, rows, chunks)
            assert got.shape == (rows.shape[0], vocab)
            gap = mx.abs(got - expected).max().item()
            assert _agree(got, expected), (bits, length, chunks, rows.shape, gap)


def _heads_by_mlx_ops(self, qkv, starts, length=1):
    """``AttentionHeads.fused`` as MLX's ops, as the model code runs them."""
    rows = qkv.shape[0] // length
    q, k, v = mx.split(qkv, self.split, axis=-1)

    def heads(a, count, norm):
        a = a.reshape(rows, length, count, -1).transpose(0, 2, 1, 3)
        return a if norm is None else self.rope(mx.fast.rms_norm(a, norm, self.eps), offset=starts[0].item())

    return heads(q, self.heads, self.q_norm), heads(k, self.kv_heads, self.k_norm), heads(v, self.kv_heads, None)


@pytest.mark.skipif(uses_kernels(), reason="the kernels themselves run there (the tests above)")
@pytest.mark.parametrize("bits", [None, 4])
def test_a_pass_laid_out_as_on_cuda_equals_the_model_code(monkeypatch, bits):
    """On CUDA a pass runs its layers as the decode step does: the heads and the residual
    norms as the engine's kernels, each layer handing the next its input's norm. Those
    kernels cannot run here, so MLX's own ops (the model code's) stand in for them: the
    pass around them then gives the model code's logits to the bit, in one pass and in
    two (past the sliding window), for one prompt and two stacked."""
    monkeypatch.setattr(cuda_heads.AttentionHeads, "fits", lambda self, dtype: True)
    monkeypatch.setattr(cuda_heads.AttentionHeads, "fused", _heads_by_mlx_ops)
    monkeypatch.setattr(cuda_norms, "fits", lambda x: True)
    monkeypatch.setattr(cuda_norms, "fused_add_norm", cuda_norms.add_norm_by_ops)
    path = cached_model("gemma3", bits=bits)
    skip_where_refused(str(path))
    reference, _ = vlm_load(str(path))
    model, _ = vlm_load(str(path))
    family = family_for(model)
    vocab = reference.language_model.model.embed_tokens.weight.shape[0]
    window = reference.language_model.model.window_size
    for length, chunks in ((20, [20]), (64, [30, 34]), (3 * window, [window, 2 * window])):
        ids = mx.random.randint(3, vocab, (2, length), key=mx.random.key(length))
        for rows in (ids[:1], ids):
            expected = _passes(reference, _ModelCode(), rows, chunks)
            assert mx.array_equal(_passes(model, family, rows, chunks), expected).item(), (bits, chunks, rows.shape)


def test_padded_rows_take_their_own_last_logits_on_either_path():
    """A pass of rows padded to one length gives each row the logits of its own last
    token, through the decoder and through the model code alike."""
    path = cached_model("gemma3")
    reference, _ = vlm_load(str(path))
    model, _ = vlm_load(str(path))
    family = family_for(model)
    vocab = reference.language_model.model.embed_tokens.weight.shape[0]
    lengths = [9, 14]
    ids = mx.random.randint(3, vocab, (2, max(lengths)), key=mx.random.key(7))
    ends = mx.array([n - 1 for n in lengths], mx.int32)
    for runner, lm_model in ((family, model), (_ModelCode(), reference)):
        lm = lm_model.language_model
        logits, _ = prefill_pass(lm_model, runner, ids, lm.model.embed_tokens(ids), lm.make_cache(), {},
                                 last_positions=ends)
        for row, n in enumerate(lengths):
            alone = _passes(reference, _ModelCode(), ids[row:row + 1, :n], [n])
            assert _agree(logits[row:row + 1], alone), (type(runner).__name__, n)
