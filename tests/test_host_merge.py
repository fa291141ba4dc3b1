"""LLaVA, InternVL, Mistral 3, Idefics3 and SmolVLM put their images' features into the
prompt's embeddings at positions found on the host (``families/host_merge.py``), and
Kimi-VL's tower takes its images' grid shapes from the host (``families/kimi_vl.py``),
not by the model code's reads of device arrays, each of which waits for all queued
device work. The embeddings equal the model code's (a second copy of the model, as
mlx-vlm loads it) to the bit, and embedding a prompt waits for no work queued before it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine.families import SerialFamily, family_for, host_merge, idefics3_embed
from vlm_serve.engine.loader import load

from conftest import assert_embeds_without_waiting, engine_and_plain, make_image, prompt_inputs

ARCHS = ["llava", "internvl_chat", "mistral3", "idefics3", "smolvlm", "kimi_vl"]
# Idefics3's model code (SmolVLM's too) drops padding images and counts patches itself.
IDEFICS3 = ["idefics3", "smolvlm"]


@pytest.fixture(scope="module", params=ARCHS)
def models(request):
    return engine_and_plain(request.param)


def model_code_embeds(plain, ids, inputs) -> mx.array:
    """The prompt's embeddings as mlx-vlm's own copy of the model computes them."""
    rest = dict(inputs)
    pixels, mask = rest.pop("pixel_values", None), rest.pop("attention_mask", None)
    return plain.get_input_embeddings(ids, pixels, mask=mask, **rest).inputs_embeds


def assert_same_bits(embeds: mx.array, expected: mx.array) -> None:
    assert embeds.dtype == expected.dtype and embeds.shape == expected.shape
    assert mx.array_equal(embeds, expected).item()


def test_the_merge_equals_the_model_code(models):
    loaded, plain = models
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 1)])
    assert_same_bits(loaded.family.embed(ids, inputs)[0], model_code_embeds(plain, ids, inputs))
    image_token = getattr(plain.config, "image_token_index", None)
    assert image_token is not None and (np.asarray(ids) == image_token).any(), "the prompt holds image tokens"


def test_two_images_of_other_sizes_equal_the_model_code(models):
    loaded, plain = models
    if loaded.model_type == "llava":
        pytest.skip("mlx-vlm's LLaVA takes one image per prompt")
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 3), make_image(30, 90, 4)])
    assert_same_bits(loaded.family.embed(ids, inputs)[0], model_code_embeds(plain, ids, inputs))


def test_a_text_prompt_equals_the_model_code(models):
    loaded, plain = models
    ids, inputs = prompt_inputs(loaded, [], "Only words here.")
    assert "pixel_values" not in inputs
    assert_same_bits(loaded.family.embed(ids, inputs)[0], model_code_embeds(plain, ids, inputs))


@pytest.fixture(scope="module", params=IDEFICS3)
def idefics3_models(request):
    return engine_and_plain(request.param)


def test_padding_images_and_masked_patches_equal_the_model_code(idefics3_models):
    """The processor pads a batch's image lists with images of zeros (pixels and pixel
    mask), and an image smaller than the batch's largest has a mask of zeros where it
    is padded: the model code drops the first and counts the second's patches."""
    loaded, plain = idefics3_models
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 5)])
    pixels, pixel_mask = np.array(inputs["pixel_values"]), np.array(inputs["pixel_attention_mask"])
    height, width = pixels.shape[-2:]
    pixels[0, 1, :, height // 2:, :] = 0  # an image padded below and right
    pixels[0, 1, :, :, width // 3:] = 0
    pixel_mask[0, 1, height // 2:, :] = 0
    pixel_mask[0, 1, :, width // 3:] = 0
    padding = np.zeros_like(pixels[:, :1])  # one first too: the real ones are then not a prefix
    inputs = {**inputs, "pixel_values": mx.array(np.concatenate([padding, pixels, padding], axis=1)),
              "pixel_attention_mask": mx.array(np.concatenate([np.zeros_like(pixel_mask[:, :1]), pixel_mask,
                                                               np.zeros_like(pixel_mask[:, :1])], axis=1))}
    assert idefics3_embed.real_images(np.asarray(inputs["pixel_values"])[0]).tolist() == list(range(1, pixels.shape[1] + 1))
    assert_same_bits(loaded.family.embed(ids, inputs)[0], model_code_embeds(plain, ids, inputs))
    # ... and without a pixel mask, where the model code takes every pixel as valid.
    del inputs["pixel_attention_mask"]
    assert_same_bits(loaded.family.embed(ids, inputs)[0], model_code_embeds(plain, ids, inputs))


def test_a_resent_image_takes_its_features_from_the_vision_cache(idefics3_models, monkeypatch):
    """Idefics3's and SmolVLM's features are kept by the vision cache: the same images
    again run no tower, and the prompt still gets the model code's embeddings (two
    images of other sizes)."""
    loaded, plain = idefics3_models
    family = loaded.family
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 6), make_image(30, 90, 7)])
    towers, encode = [], family.encode_images
    monkeypatch.setattr(family, "encode_images", lambda *args: towers.append(args) or encode(*args))
    expected = model_code_embeds(plain, ids, inputs)
    for _ in range(2):
        assert_same_bits(family.embed(ids, inputs, image_key=("resent-pair",))[0], expected)
    assert len(towers) == 1


def test_pixtrals_block_mask_equals_its_own():
    from mlx_vlm.models.pixtral import vision

    host_merge._install_block_mask()
    original = host_merge._block_mask.original
    tensor = mx.zeros((2, 23, 8), mx.bfloat16)
    for blocks in ([23], [6, 12, 5], [1, 22]):
        assert mx.array_equal(vision.generate_block_attention_mask(blocks, tensor), original(blocks, tensor)).item()


def assert_no_wait(loaded, family) -> None:
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 2)])
    assert_embeds_without_waiting(family, ids, inputs)


def test_embedding_a_prompt_waits_for_no_queued_work(models):
    """The model code's merge (Idefics3's padding images and patch counts, Kimi-VL's
    tower's grid shapes too) waits for all the work queued before it."""
    loaded, _ = models
    assert_no_wait(loaded, loaded.family)


def test_kimi_vl_served_one_row_at_a_time_waits_for_no_queued_work(model_path):
    """On CUDA a ``SerialFamily`` serves Kimi-VL (it has no engine decode step), built
    on the model its own family was built on (``families._row_exact``)."""
    loaded = load(str(model_path("kimi_vl")))
    family_for(loaded.model)
    assert_no_wait(loaded, SerialFamily(loaded.model))
