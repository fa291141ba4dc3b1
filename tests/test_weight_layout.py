"""On the CPU, float32 weights are stored input-major for BLAS (``weight_layout``): the
model computes the same logits to the bit, a tied weight stays one array, and the served
engine decodes on weights laid out so, fused ones included.

numpy's view of an MLX array shows its strides: a laid-out (out, in) weight is the
transposed view of an (in, out) array."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_vlm import load as vlm_load
from mlx_vlm.models import cache as vlm_cache

from vlm_serve.engine import weight_layout
from vlm_serve.engine.engine import Engine
from vlm_serve.engine.scheduler import SchedulerConfig
from vlm_serve.fixtures.build import cached_model

ARCHS = ["gemma3", "qwen2_5_vl", "gemma4"]


def _float_weights(model) -> list[mx.array]:
    return [
        m.weight for _, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Embedding)) and "weight" in m and m.weight.dtype == mx.float32
    ]


def _input_major(weight: mx.array) -> bool:
    """Whether an (out, in) weight runs along its output dimension in memory (a fused
    layer's parts are row slices of such a view)."""
    return np.asarray(weight).strides[0] == weight.itemsize


def _prefill_and_step(model, ids: mx.array) -> tuple[mx.array, mx.array]:
    """Logits of a two-row prompt pass and of one decode step after it."""
    lm = model.language_model
    cache = vlm_cache.make_prompt_cache(lm)
    prompt = lm(ids[:, :-1], cache=cache).logits
    step = lm(ids[:, -1:], cache=cache).logits
    mx.eval(prompt, step)
    return prompt, step


@pytest.mark.parametrize("arch", ARCHS)
def test_laid_out_weights_give_the_models_logits_to_the_bit(arch):
    path = str(cached_model(arch))
    model, _ = vlm_load(path)
    reference, _ = vlm_load(path)
    weights = _float_weights(model)
    assert weights and not any(_input_major(w) for w in weights)

    assert weight_layout.lay_out(model) > 0
    assert all(_input_major(w) for w in _float_weights(model))
    ids = mx.array(np.random.default_rng(0).integers(10, 300, (2, 41)), mx.int32)
    for laid_out, plain in zip(_prefill_and_step(model, ids), _prefill_and_step(reference, ids)):
        assert mx.array_equal(laid_out, plain).item()


def test_a_tied_output_layer_still_shares_the_embedding():
    model, _ = vlm_load(str(cached_model("gemma3")))
    lm = model.language_model
    assert lm.lm_head.weight is lm.model.embed_tokens.weight  # mlx-vlm ties them
    weight_layout.lay_out(model)
    assert lm.lm_head.weight is lm.model.embed_tokens.weight
    assert _input_major(lm.lm_head.weight)


def test_other_backends_keep_the_checkpoints_layout(monkeypatch):
    # No GPU here: the backend's answer is replaced, the rest runs as it would.
    monkeypatch.setattr(weight_layout, "wants_input_major", lambda: False)
    model, _ = vlm_load(str(cached_model("gemma3")))
    assert weight_layout.lay_out(model) == 0
    assert not any(_input_major(w) for w in _float_weights(model))


def test_the_served_engine_decodes_on_laid_out_weights():
    engine = Engine(str(cached_model("gemma3")), SchedulerConfig(max_num_seqs=2))
    engine.start()
    try:
        model = engine.loaded.model
        assert all(_input_major(w) for w in _float_weights(model))
        decoder = engine.scheduler.batch.decoder
        layer = decoder.layers[0]
        assert _input_major(layer.qkv.weight_t.T) and _input_major(layer.gate_up.weight_t.T)
    finally:
        engine.shutdown()
