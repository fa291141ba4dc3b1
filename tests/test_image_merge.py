"""Gemma 3 puts its images' features into the prompt's embeddings on the device
(``Gemma3.merge``), not by the model's NumPy scatter, which reads the prompt back and
so waits for all queued device work. The embeddings and the model's other output equal
``get_input_embeddings``' to the bit: one image, two images, features from a shared
tower call, padding tokens among the text, and in bfloat16."""

from __future__ import annotations

import mlx.core as mx
import pytest

from vlm_serve.engine.families import family_for
from vlm_serve.engine.loader import load

from conftest import make_image, prompt_inputs


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def loaded(request, model_path):
    loaded = load(str(model_path("gemma3")))
    if request.param == "bfloat16":
        loaded.model.set_dtype(mx.bfloat16)
    loaded.family = family_for(loaded.model)
    return loaded


def _model_code(loaded, ids: mx.array, inputs: dict) -> tuple[mx.array, mx.array]:
    inputs = dict(inputs)
    pixels, mask = inputs.pop("pixel_values"), inputs.pop("attention_mask", None)
    out = loaded.model.get_input_embeddings(ids, pixels, mask=mask, **inputs)
    return out.inputs_embeds, out.attention_mask_4d


def _assert_same(got: tuple[mx.array, dict], expected: tuple[mx.array, mx.array]) -> None:
    embeds, kwargs = got
    assert embeds.dtype == expected[0].dtype and embeds.shape == expected[0].shape
    assert mx.array_equal(embeds, expected[0]).item()
    assert mx.array_equal(kwargs["attention_mask_4d"], expected[1]).item()


@pytest.mark.parametrize("count", [1, 2])
def test_the_merge_equals_the_model_code(loaded, count):
    family = loaded.family
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, seed) for seed in range(count)])
    expected = _model_code(loaded, ids, inputs)
    # The family runs the tower itself (and keeps the features under the key)...
    _assert_same(family.embed(ids, inputs, image_key=(f"merge-{count}",)), expected)
    # ...or is handed the features, as a shared tower call or the vision cache does.
    features = family.encode_images(ids, inputs["pixel_values"], {})
    rest = {k: v for k, v in inputs.items() if k != "pixel_values"}
    _assert_same(family.embed(ids, rest, features=features), expected)


def test_features_of_a_shared_tower_call_merge_as_the_model_code(loaded):
    family = loaded.family
    prompts = [prompt_inputs(loaded, [make_image(40, 56, seed)]) for seed in (3, 4)]
    stacked = mx.concatenate([inputs["pixel_values"] for _, inputs in prompts])
    features = family.split_image_features(
        family.encode_images(prompts[0][0], stacked, {}), [inputs for _, inputs in prompts])
    for (ids, inputs), own in zip(prompts, features):
        rest = {k: v for k, v in inputs.items() if k != "pixel_values"}
        _assert_same(family.embed(ids, rest, features=own), _model_code(loaded, ids, inputs))


def test_padding_tokens_among_the_text_embed_as_zeros_as_in_the_model_code(loaded):
    family = loaded.family
    ids, inputs = prompt_inputs(loaded, [make_image(48, 48, 5)])
    pad = loaded.model.config.pad_token_id or 0
    image = loaded.model.config.image_token_index
    tokens = ids[0].tolist()
    text = [i for i, t in enumerate(tokens) if t != image]
    for i in text[-4:-1]:
        tokens[i] = pad
    ids = mx.array(tokens, mx.int32)[None]
    features = family.encode_images(ids, inputs["pixel_values"], {})
    rest = {k: v for k, v in inputs.items() if k != "pixel_values"}
    embeds, kwargs = family.embed(ids, rest, features=features)
    _assert_same((embeds, kwargs), _model_code(loaded, ids, inputs))
    assert not mx.any(embeds[0, mx.array(text[-4:-1])]).item()
