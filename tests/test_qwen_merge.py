"""Qwen2-VL and Qwen2.5-VL put their images' features into the prompt's embeddings, and
work out their 3-axis positions, from the token ids on the host (``QwenVL.merge``), not
by the model's reads of device arrays (``.item()``, ``.tolist()``), each of which waits
for all queued device work. The embeddings, positions and rope deltas equal
``get_input_embeddings``' to the bit: text alone, one image, two images, features from
a shared tower call, a masked-out token, and in bfloat16; and embedding a prompt does
not wait for work queued before it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine.families import family_for
from vlm_serve.engine.loader import load

from conftest import assert_embeds_without_waiting, make_image, prompt_inputs


@pytest.fixture(scope="module", params=["qwen2_5_vl-float32", "qwen2_5_vl-bfloat16", "qwen2_vl-float32"])
def loaded(request, model_path):
    arch, dtype = request.param.split("-")
    loaded = load(str(model_path(arch)))
    if dtype == "bfloat16":
        loaded.model.set_dtype(mx.bfloat16)
    loaded.family = family_for(loaded.model)
    return loaded


def _model_code(loaded, ids: mx.array, inputs: dict) -> tuple[mx.array, dict]:
    inputs = dict(inputs)
    pixels, mask = inputs.pop("pixel_values", None), inputs.pop("attention_mask", None)
    if mask is None:
        mask = mx.ones(ids.shape, mx.int32)
    out = loaded.model.get_input_embeddings(ids, pixels, mask=mask, **inputs)
    return out.inputs_embeds, {"position_ids": out.position_ids, "rope_deltas": out.rope_deltas}


def _assert_same(got: tuple[mx.array, dict], expected: tuple[mx.array, dict]) -> None:
    embeds, kwargs = got
    assert embeds.dtype == expected[0].dtype and embeds.shape == expected[0].shape
    assert mx.array_equal(embeds, expected[0]).item()
    for name, want in expected[1].items():
        assert kwargs[name].dtype == want.dtype and kwargs[name].shape == want.shape, name
        assert mx.array_equal(kwargs[name], want).item(), name


def _without_pixels(inputs: dict) -> dict:
    return {k: v for k, v in inputs.items() if k != "pixel_values"}


@pytest.mark.parametrize("count", [1, 2])
def test_the_merge_equals_the_model_code(loaded, count):
    family = loaded.family
    ids, inputs = prompt_inputs(loaded, [make_image(56 + 28 * seed, 56, seed) for seed in range(count)])
    expected = _model_code(loaded, ids, inputs)
    # The family runs the tower itself (and keeps the features under the key)...
    _assert_same(family.embed(ids, inputs, image_key=(f"qwen-merge-{count}",)), expected)
    # ...or is handed the features, as a shared tower call or the vision cache does.
    features = family.encode_images(ids, inputs["pixel_values"], inputs)
    _assert_same(family.embed(ids, _without_pixels(inputs), features=features), expected)


def test_text_alone_equals_the_model_code(loaded):
    ids, inputs = prompt_inputs(loaded, [], "Say something about the sea.")
    _assert_same(loaded.family.embed(ids, inputs), _model_code(loaded, ids, inputs))


def test_features_of_a_shared_tower_call_merge_as_the_model_code(loaded):
    family = loaded.family
    prompts = [prompt_inputs(loaded, [make_image(56, 84, seed)]) for seed in (3, 4)]
    images = [{k: inputs[k] for k in ("pixel_values", "image_grid_thw")} for _, inputs in prompts]
    stacked = family.stack_image_inputs(images)
    features = family.split_image_features(family.encode_images(prompts[0][0], stacked["pixel_values"], stacked),
                                           [inputs for _, inputs in prompts])
    for (ids, inputs), own in zip(prompts, features):
        _assert_same(family.embed(ids, _without_pixels(inputs), features=own), _model_code(loaded, ids, inputs))


def test_a_masked_out_token_gets_the_model_codes_positions(loaded):
    family = loaded.family
    ids, inputs = prompt_inputs(loaded, [make_image(56, 56, 6)])
    mask = np.ones(ids.shape, np.int32)
    mask[0, 1] = 0  # a text token before the image
    inputs = {**inputs, "attention_mask": mx.array(mask)}
    features = family.encode_images(ids, inputs["pixel_values"], inputs)
    _assert_same(family.embed(ids, _without_pixels(inputs), features=features), _model_code(loaded, ids, inputs))


def test_embedding_a_prompt_waits_for_no_queued_work(loaded):
    """The embedding is built and the row's rope delta read while work queued before
    them still runs: nothing was read back from the device. The model code's merge
    waits for all of it."""
    family = loaded.family
    ids, inputs = prompt_inputs(loaded, [make_image(56, 56, 7)])
    features = family.encode_images(ids, inputs["pixel_values"], inputs)
    assert_embeds_without_waiting(family, ids, _without_pixels(inputs), features)
