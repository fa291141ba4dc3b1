"""Gemma 4 decodes through the engine's own step (``decode/gemma4.py``), and batched rows
equal each row decoded alone.

The tiny fixture has sliding and full layers with different head sizes, per-layer
inputs and two KV-shared layers (the store holds the four layers before them). A second
variant of it, written here from the fixture's weights, turns on ``attention_k_eq_v``
with its own kv head count on full layers (no value projection: values are the raw
keys), and gives the norms and layer scalars weights other than one.

The oracle is mlx-vlm's ``generate_step`` on a separately loaded copy of the model, one
request at a time, fed the same token ids and processor outputs as the engine. The
parity suites (``test_parity.py``, ``test_families.py``) run the fixture itself through
the engine too; here rows run long enough to wrap the sliding window (32). Below
that, the step's logits are compared to the bit with the model code's, Gemma 3's too
(the slot store's ring is theirs).
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm import load as vlm_load

from vlm_serve.engine.decode import Gemma4Decoder
from vlm_serve.engine.families.gemma import Gemma4
from vlm_serve.engine.types import SamplingParams
from vlm_serve.fixtures.build import cached_model

from conftest import make_image
from oracle import FullLengthHarness, assert_each_matches_alone, prefilled_alone, skip_on_cuda_against_model_code
from test_parity import LONG_TEXT, run_jobs

PREFILL_STEP = 32
WINDOW = 32  # the fixture's sliding window
GLOBAL_KV_HEADS = 2  # the k_eq_v variant's kv heads on full-attention layers


def write_k_eq_v_variant(source, out) -> None:
    """The tiny fixture with ``attention_k_eq_v`` on: its full-attention layers that own
    KV lose their value projection and get a key projection for GLOBAL_KV_HEADS heads;
    norms and layer scalars get weights other than one."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    text["attention_k_eq_v"] = True
    text["num_global_key_value_heads"] = GLOBAL_KV_HEADS
    (out / "config.json").write_text(json.dumps(config, indent=2))
    owners = text["num_hidden_layers"] - text["num_kv_shared_layers"]
    full = [i for i, kind in enumerate(text["layer_types"][:owners]) if kind == "full_attention"]
    weights = mx.load(str(out / "model.safetensors"))
    key = mx.random.key(4)
    for name in list(weights):
        if not name.startswith("language_model."):
            continue
        key, sub = mx.random.split(key)
        if name.endswith("norm.weight") or name.endswith("layer_scalar"):
            weights[name] = 1.0 + 0.2 * mx.random.normal(weights[name].shape, key=sub)
        for i in full:
            prefix = f"language_model.model.layers.{i}.self_attn."
            if name == prefix + "v_proj.weight":
                del weights[name]
            elif name == prefix + "k_proj.weight":
                rows = GLOBAL_KV_HEADS * text["global_head_dim"]
                std = text["hidden_size"] ** -0.5
                weights[name] = std * mx.random.normal((rows, text["hidden_size"]), key=sub)
    mx.save_safetensors(str(out / "model.safetensors"), weights)


@pytest.fixture(scope="module")
def k_eq_v_path(tmp_path_factory):
    out = tmp_path_factory.mktemp("gemma4-k-eq-v") / "model"
    write_k_eq_v_variant(cached_model("gemma4"), out)
    return out


@pytest.fixture(scope="module", params=["f32", "q4", "k_eq_v"])
def harness(request, k_eq_v_path):
    if request.param == "k_eq_v":
        path = k_eq_v_path
    else:
        path = cached_model("gemma4", bits=4 if request.param == "q4" else None)
    h = FullLengthHarness(str(path), PREFILL_STEP)  # every row runs across the window's wrap
    h.variant = request.param
    yield h
    h.shutdown()


def test_gemma4_decodes_through_its_own_step_on_the_kv_owning_layers(harness):
    run_jobs(harness.engine, [(harness.prepare("probe", "Hi", max_tokens=3, chat=False), None, None)])
    batch = harness.engine.scheduler.batch
    assert type(batch.decoder) is Gemma4Decoder
    text = harness.oracle_model.language_model.model
    owners = text.first_kv_shared_layer_idx
    assert 0 < owners < len(text.layers)  # the fixture has KV-shared layers
    kinds = batch.store.layer_kinds
    assert len(kinds) == owners  # the shared layers hold no KV of their own
    config = text.config
    kv_heads = GLOBAL_KV_HEADS if harness.variant == "k_eq_v" else config.num_key_value_heads
    for kind, layer_type in zip(kinds, config.layer_types):
        if layer_type == "full_attention":
            assert (kind.window, kind.kv_heads, kind.head_dim) == (
                None, kv_heads, config.global_head_dim)
        else:
            assert (kind.window, kind.kv_heads, kind.head_dim) == (
                WINDOW, config.num_key_value_heads, config.head_dim)
    if harness.variant == "k_eq_v":
        full = next(i for i, t in enumerate(config.layer_types) if t == "full_attention")
        assert text.layers[full].self_attn.use_k_eq_v
        assert "v_proj" not in text.layers[full].self_attn


def test_rows_across_the_window_joining_and_leaving_match_alone(harness):
    h = harness
    jobs = [
        # Raw prompts of a few tokens: their sliding window fills and wraps while decoding.
        (h.prepare("raw-short", "Hi", max_tokens=44, chat=False), None, None),
        (h.prepare("raw-mid", LONG_TEXT[:60], max_tokens=40, chat=False), None, None),
        # Chat prompts: hundreds of tokens, each at its own place in the ring.
        (h.prepare("chat-short", "Hi!", max_tokens=20), None, None),
        (h.prepare("chat-image", "Describe this picture.", [make_image(60, 40, 1)], 24), None, None),
        (h.prepare("chat-long", LONG_TEXT[:300] + " Summarise.", max_tokens=30), None, None),
        # Joining mid-decode, after others have left or while they run.
        (h.prepare("late-text", "What colours are here, and why?", max_tokens=30),
         ("raw-short", 9), None),
        (h.prepare("late-image", "Read it.", [make_image(90, 120, 2)], max_tokens=26),
         ("chat-short", 17), None),
    ]
    results = run_jobs(h.engine, jobs)
    assert type(h.engine.scheduler.batch.decoder) is Gemma4Decoder
    assert h.engine.scheduler.peak_running >= 5  # the rows really shared decode steps
    assert_each_matches_alone(jobs, results, h.oracle, h.variant)


def test_moe_gemma4_stays_on_the_model_code():
    """The mixture-of-experts variant has no engine step: the family says so up front,
    and the step refuses it (``Family.decoder`` then falls back with a warning)."""
    model, _ = vlm_load(str(cached_model("gemma4")))
    model.language_model.config.enable_moe_block = True  # only the flag is read
    family = Gemma4(model)
    assert family.decoder() is None
    assert "model code" in family.describe()
    with pytest.raises(TypeError):
        Gemma4Decoder(model)


@pytest.fixture(params=["mask", "counts"])
def visible_keys(request, monkeypatch):
    """How the step tells attention which keys a row sees: a mask (MLX's attention), or
    counts (the CUDA kernels' form: the whole store, each row's count of keys). The
    kernels need CUDA, so here their MLX reference stands in for them: what this checks
    is the counts' plumbing (per layer kind, windows and KV-shared layers included)."""
    from vlm_serve.engine.decode import cuda_attention, step

    if request.param == "counts":
        monkeypatch.setattr(step, "uses_kernels", lambda: True)
        monkeypatch.setattr(cuda_attention, "decode_attention", cuda_attention.reference_attention)
    return request.param


@pytest.mark.parametrize("arch,bits", [("gemma4", None), ("gemma4", 4), ("gemma3", None)],
                         ids=["gemma4-f32", "gemma4-q4", "gemma3-f32"])
def test_step_logits_equal_alone_bitwise_across_the_window(arch, bits, visible_keys):
    """Rows of different lengths, some past the sliding window (32) from the start, fed
    the same tokens batched (the engine step) and each alone (the model code on its own
    caches): every row's logits are equal to the bit at every step. The store's ring
    keeps each row's keys in the columns its own rotating cache would, so attention sums
    them in the same order."""
    from vlm_serve.engine.batch import Batch, JoiningRow
    from vlm_serve.engine.families import family_for
    from vlm_serve.engine.sampling import BatchSampler

    skip_on_cuda_against_model_code()
    model, _ = vlm_load(str(cached_model(arch, bits=bits)))
    lm = model.language_model
    family = family_for(model)
    rng = np.random.default_rng(7)
    vocab = lm(mx.zeros((1, 1), mx.int32)).logits.shape[-1]
    prompts = [rng.integers(20, vocab, n).astype(np.int32) for n in (70, 45, 33, 20, 9)]
    steps = 40
    fed = rng.integers(20, vocab, (len(prompts), steps)).astype(np.int32)

    alone = []
    for i, ids in enumerate(prompts):
        cache = prefilled_alone(model, family, f"r{i}", ids).cache
        alone.append([np.array(lm(mx.array(fed[i, s:s + 1])[None], cache=cache).logits[0, -1])
                      for s in range(steps)])
    batch = Batch(model, family, vocab)
    assert batch.store is not None
    assert batch.decoder.counts == (visible_keys == "counts")
    for i, ids in enumerate(prompts):
        prefill = prefilled_alone(model, family, f"r{i}", ids)
        sampler = BatchSampler(vocab)
        sampler.add(SamplingParams(temperature=0.0), [])
        first = sampler.sample(prefill.logits).tokens
        batch.add([JoiningRow(prefill.cache, sampler, first, prefill.row_state)])
    for s in range(steps):
        batch.next_tokens = mx.array(fed[:, s])
        logits = np.array(batch._logits())
        for i in range(len(prompts)):
            assert np.array_equal(logits[i], alone[i][s]), f"{arch} row {i} step {s}"
