"""Qwen3-VL embeds a prompt without the model code's reads of device arrays, each of
which waits for all queued device work: its tower takes the grids and bounds from the
host and runs its index functions on a stream of their own (``families/qwen3_tower.py``),
and its merge finds the image positions in the host's token ids (``Qwen3VL.merge``).
The embeddings, positions, rope deltas, visual masks and DeepStack features equal a
plain copy of the model's (as mlx-vlm loads it) to the bit: text alone, one image, two
images of different sizes, from the tower's outputs handed back (the vision cache) and
from a tower call shared by two prompts, a masked-out token, in float32 and bfloat16; and embedding a
prompt waits for no work queued before it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine.families import qwen3_tower

from conftest import assert_embeds_without_waiting, engine_and_plain, make_image, prompt_inputs


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def models(request):
    return engine_and_plain("qwen3_vl", request.param)


def _model_code(plain, ids: mx.array, inputs: dict) -> tuple[mx.array, dict]:
    inputs = dict(inputs)
    pixels, mask = inputs.pop("pixel_values", None), inputs.pop("attention_mask", None)
    if mask is None:
        mask = mx.ones(ids.shape, mx.int32)
    out = plain.get_input_embeddings(ids, pixels, mask=mask, **inputs).to_dict()
    names = ("position_ids", "rope_deltas", "visual_pos_masks", "deepstack_visual_embeds")
    return out["inputs_embeds"], {k: out[k] for k in names if out.get(k) is not None}


def _assert_equal(got: mx.array, want: mx.array, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert mx.array_equal(got, want).item(), name


def _assert_same(got: tuple[mx.array, dict], expected: tuple[mx.array, dict]) -> None:
    _assert_equal(got[0], expected[0], "inputs_embeds")
    for name, want in expected[1].items():
        if name == "deepstack_visual_embeds":
            assert len(got[1][name]) == len(want) > 0
            for layer, (a, b) in enumerate(zip(got[1][name], want)):
                _assert_equal(a, b, f"{name}[{layer}]")
        else:
            _assert_equal(got[1][name], want, name)


@pytest.mark.parametrize("sizes", [[(64, 48)], [(64, 64), (96, 64)]])
def test_the_merge_equals_the_model_code(models, sizes):
    loaded, plain = models
    assert isinstance(loaded.model.vision_tower, qwen3_tower.SideStreamTower)
    images = [make_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    ids, inputs = prompt_inputs(loaded, images)
    expected = _model_code(plain, ids, inputs)
    assert "deepstack_visual_embeds" in expected[1] and "visual_pos_masks" in expected[1]
    _assert_same(loaded.family.embed(ids, inputs), expected)
    # The same from the tower's outputs handed back, as the vision cache does.
    rest = {k: v for k, v in inputs.items() if k != "pixel_values"}
    features = loaded.family.encode_images(ids, inputs["pixel_values"], rest)
    _assert_same(loaded.family.embed(ids, rest, features=features), expected)


def test_features_of_a_shared_tower_call_merge_as_the_model_code(models):
    loaded, plain = models
    family = loaded.family
    prompts = [prompt_inputs(loaded, [make_image(64, 48, seed)]) for seed in (3, 4)]
    images = [{k: inputs[k] for k in ("pixel_values", "image_grid_thw")} for _, inputs in prompts]
    stacked = family.stack_image_inputs(images)
    shared = family.encode_images(prompts[0][0], stacked["pixel_values"], stacked)
    for (ids, inputs), own in zip(prompts, family.split_image_features(shared, [i for _, i in prompts])):
        rest = {k: v for k, v in inputs.items() if k != "pixel_values"}
        _assert_same(family.embed(ids, rest, features=own), _model_code(plain, ids, inputs))


def test_text_alone_equals_the_model_code(models):
    loaded, plain = models
    ids, inputs = prompt_inputs(loaded, [], "Say something about the sea.")
    _assert_same(loaded.family.embed(ids, inputs), _model_code(plain, ids, inputs))


def test_a_masked_out_token_gets_the_model_codes_positions(models):
    loaded, plain = models
    ids, inputs = prompt_inputs(loaded, [make_image(64, 64, 6)])
    mask = np.ones(ids.shape, np.int32)
    mask[0, 1] = 0  # a text token before the image
    inputs = {**inputs, "attention_mask": mx.array(mask)}
    _assert_same(loaded.family.embed(ids, inputs), _model_code(plain, ids, inputs))


def test_embedding_a_prompt_waits_for_no_queued_work(models):
    """The tower call, the merge, the row's rope delta and a prefill chunk's share of
    the DeepStack features are all built while work queued before them still runs.
    The model code waits for all of it."""
    loaded, _ = models
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 7), make_image(48, 64, 8)])
    assert_embeds_without_waiting(loaded.family, ids, inputs)
