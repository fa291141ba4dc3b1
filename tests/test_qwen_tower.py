"""Qwen2-VL's and Qwen2.5-VL's vision towers with their index arithmetic on the host
(``families/qwen_tower.py``): the features equal the model code's (a plain copy of the
model, as mlx-vlm loads it) to the bit, for one image, for images of different sizes in
one call, and for a grid that fills its windows exactly (where the model code meets
empty windows); and a tower call waits for no work queued before it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine.families import qwen_tower
from vlm_serve.mlx_runtime import cuda_available

from conftest import engine_and_plain, make_image, prompt_inputs, time_behind_queued_work


@pytest.fixture(scope="module", params=["qwen2_5_vl-float32", "qwen2_5_vl-bfloat16", "qwen2_vl-float32"])
def models(request):
    return engine_and_plain(*request.param.split("-"))


def _images(loaded, images: list) -> dict:
    """The pixels and grids of ``images``, each prepared as a request's, in one call."""
    per_image = [prompt_inputs(loaded, [image])[1] for image in images]
    return loaded.family.stack_image_inputs([{k: i[k] for k in ("pixel_values", "image_grid_thw")} for i in per_image])


def _plain_tower(plain, inputs: dict) -> mx.array:
    dtype = plain.vision_tower.patch_embed.proj.weight.dtype
    return plain.vision_tower(inputs["pixel_values"].astype(dtype), inputs["image_grid_thw"], output_hidden_states=False)


@pytest.mark.parametrize("sizes", [[(56, 84)], [(56, 56), (112, 84)], [(224, 224)]])
def test_the_tower_gives_the_model_codes_features(models, sizes):
    loaded, plain = models
    if cuda_available() and plain.vision_tower.patch_embed.proj.weight.dtype == mx.bfloat16:
        # The engine's tower runs there (the Qwen bursts of bench/gpu/burst.sh), but the
        # reference cannot: mlx-vlm's tower in bfloat16 ends the process with SIGFPE.
        pytest.skip("mlx-vlm's Qwen2.5-VL tower in bfloat16 on CUDA ends the process (SIGFPE)")
    inputs = _images(loaded, [make_image(w, h, i) for i, (w, h) in enumerate(sizes)])
    assert isinstance(loaded.model.vision_tower, qwen_tower.HostIndexedTower)
    features = loaded.family.encode_images(None, inputs["pixel_values"], inputs)
    expected = _plain_tower(plain, inputs)
    assert features.dtype == expected.dtype and features.shape == expected.shape
    assert mx.array_equal(features, expected).item()


def test_a_tower_call_waits_for_no_queued_work(models):
    """The model code's tower reads its bounds back in every layer, each read waiting
    for all the work queued before it."""
    loaded, _ = models
    inputs = _images(loaded, [make_image(56, 84, 5), make_image(84, 56, 6)])
    mx.eval(loaded.family.encode_images(None, inputs["pixel_values"], inputs))  # first use's setup
    grids = np.asarray(inputs["image_grid_thw"])
    spent, queued = time_behind_queued_work(
        lambda: loaded.family.encode_images(None, inputs["pixel_values"], {"image_grid_thw": mx.array(grids)}))
    assert spent < queued / 4, f"the tower call took {spent:.2f} s behind {queued:.2f} s of queued work"
