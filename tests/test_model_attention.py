"""On CUDA the attention of mlx-vlm's language models runs on the engine's kernel
(``engine/model_attention.py``). The kernel runs only on CUDA
(``tests/test_cuda_attention.py`` checks it against MLX's attention there); here, with
no GPU, ``cuda_attention.prefill_attention`` is replaced by its MLX reference so that
what the routing hands the kernel (the queries' causal flag and mask rows, read from
each family's real calls) can be checked against the model code's own attention on
the real tiny models: the same logits, and the same greedy tokens, images included
(Gemma 4's image tokens see each other both ways)."""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm import load
from mlx_vlm.models.cache import make_prompt_cache

from vlm_serve.engine import model_attention, row_exact
from vlm_serve.engine.decode import attention, cuda_attention
from vlm_serve.engine.families import family_for
from vlm_serve.engine.model_inputs import model_arrays
from vlm_serve.engine.loader import resolve_chat_template
from vlm_serve.engine.types import SamplingParams
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat

from conftest import make_image
from oracle import mlx_vlm_greedy

# The families whose prefill is mlx-vlm's model code (Gemma 3 has the engine's own).
ARCHS = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "gemma4", "glm4v", "mistral3", "llava",
         "idefics3", "smolvlm", "internvl_chat"]
WHOLE_PROMPT = {"glm4v"}  # mlx-vlm's own chunked prefill is wrong for it


@pytest.fixture
def kernel_calls(monkeypatch):
    """The kernel's arguments per call, the MLX reference computing its result."""
    calls = []

    def stand_in(q, keys, values, scale, window=None, group=None, causal=True, mask=None, origin=0):
        calls.append((q.shape, causal, None if mask is None else mask.shape, origin, keys.shape[2]))
        return cuda_attention.reference_prefill_attention(q, keys, values, scale, window,
                                                          causal=causal, mask=mask)

    monkeypatch.setattr(cuda_attention, "prefill_attention", stand_in)
    return calls


@pytest.fixture
def routed(monkeypatch):
    """``route`` for a test, as on CUDA, undone after it (it rebinds module globals)."""
    monkeypatch.setattr(attention, "uses_kernels", lambda: True)
    names = []

    def route(language_model):
        names.extend(model_attention.route(language_model))
        return names

    yield route
    model_attention.unroute(names)


def _image_request(model_dir, processor, model_type: str):
    ctx = PromptContext(processor, model_type, MediaPolicy(), 8, resolve_chat_template(model_dir, processor))
    parts = [{"type": "image"}, {"type": "text", "text": "What is in the picture? Say it twice."}]
    prompt = render_chat(ctx, [{"role": "user", "content": parts}])
    return prepare_prompt(ctx, "r", prompt, SamplingParams(max_tokens=6, temperature=0.0),
                          [make_image(40, 30, seed=3)])


def _logits(model, prepared) -> np.ndarray:
    """Every position's logits of one whole pass, as the engine embeds and runs it."""
    inputs = model_arrays(prepared)
    ids = mx.array(prepared.input_ids)[None]
    embeds, kwargs = family_for(model).embed(ids, inputs)
    cache = make_prompt_cache(model.language_model)
    out = model.language_model(ids, inputs_embeds=embeds, cache=cache, **kwargs)
    return np.array(out.logits.astype(mx.float32))


@pytest.mark.skipif(row_exact.applies(), reason="on CUDA the family routes attention as it loads (its "
                    "kernel is checked by tests/test_cuda_attention.py)")
@pytest.mark.parametrize("arch", ARCHS)
def test_routed_attention_computes_what_the_model_code_does(arch, model_path, kernel_calls,
                                                           routed, caplog):
    path = model_path(arch)
    model, processor = load(str(path))
    prepared = _image_request(path, processor, model.config.model_type)
    step = None if arch in WHOLE_PROMPT else 16
    theirs = _logits(model, prepared), mlx_vlm_greedy(model, prepared, step)

    names = routed(model.language_model)
    assert names, "no module of the language model was routed"
    with caplog.at_level(logging.WARNING, logger="vlm_serve.engine"):
        ours = _logits(model, prepared), mlx_vlm_greedy(model, prepared, step)
    assert not [r for r in caplog.records if "MLX's kernels" in r.getMessage()]

    lm = model.language_model
    layers = len(getattr(lm, "model", lm).layers)
    assert len(kernel_calls) >= 2 * layers  # every layer, the whole pass then each step
    if arch == "gemma4":  # its image tokens see each other both ways: a mask, not a count
        assert any(call[2] is not None for call in kernel_calls)
    np.testing.assert_allclose(ours[0], theirs[0], atol=1e-4, rtol=1e-4)
    assert ours[1] == theirs[1]


def test_the_kernel_is_told_where_each_layers_keys_start(model_path, kernel_calls, routed):
    """Gemma 4's sliding-window caches keep the last keys of wherever the previous pass
    ended, and its KV-shared layers get no cache of their own: every layer of a pass
    still hands the kernel the position of its keys' column 0 (what the kernel groups
    columns by), so the keys always end at the pass's end."""
    path = model_path("gemma4")
    model, processor = load(str(path))
    ctx = PromptContext(processor, model.config.model_type, MediaPolicy(), 8,
                        resolve_chat_template(path, processor))
    prompt = render_chat(ctx, [{"role": "user", "content": "Count the herons. " * 12}])
    prepared = prepare_prompt(ctx, "r", prompt, SamplingParams(max_tokens=4, temperature=0.0), [])
    routed(model.language_model)
    mlx_vlm_greedy(model, prepared, 16)

    layers = len(model.language_model.model.layers)
    passes = [kernel_calls[i:i + layers] for i in range(0, len(kernel_calls), layers)]
    ends = [{origin + columns for *_, origin, columns in calls} for calls in passes]
    assert all(len(end) == 1 for end in ends), ends  # one end per pass, shared layers too
    ends = [end.pop() for end in ends]
    assert ends == sorted(set(ends)) and ends[-1] >= len(prepared.input_ids)
    window = model.language_model.model.window_size
    assert any(origin > 0 for *_, origin, _ in kernel_calls) and window < len(prepared.input_ids)


def test_a_call_the_kernel_cannot_take_goes_to_mlx():
    """An additive mask says nothing about which keys a query sees: MLX takes it."""
    q = mx.zeros((1, 2, 3, 8))
    k = mx.zeros((1, 2, 5, 8))
    additive = mx.zeros((3, 5))
    assert isinstance(model_attention.kernel_plan(q, k, k, None, additive, None), str)
    assert isinstance(model_attention.kernel_plan(q, k, k, None, None, mx.zeros((2,))), str)
    assert model_attention.kernel_plan(q, k, k, None, "causal", None) == (True, None)
    causal, rows = model_attention.kernel_plan(q, k, k, None, mx.ones((1, 1, 3, 5), mx.bool_), None)
    assert not causal and rows.shape == (1, 3, 5)
