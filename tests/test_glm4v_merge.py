"""GLM-4V embeds a prompt without the model code's reads of device arrays, each of which
waits for all queued device work: its tower takes the grids and bounds from the host
and its rotary positions from a side stream (``families/glm4v_tower.py``), and its merge
and positions come from the host's token ids (``Glm4V.merge``). The embeddings equal a
plain copy of the model's ``get_input_embeddings`` to the bit, and the positions and
rope deltas its ``get_rope_index``: text alone, one image, two images of different
sizes, from the pixels or from features handed back (the vision cache), in float32 and
bfloat16; and embedding a prompt waits for no work queued before
it."""

from __future__ import annotations

import mlx.core as mx
import pytest

from vlm_serve.engine.families import glm4v_tower
from vlm_serve.mlx_runtime import cuda_available

from conftest import assert_embeds_without_waiting, engine_and_plain, make_image, prompt_inputs


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def models(request):
    return engine_and_plain("glm4v", request.param)


def _assert_equal(got: mx.array, want: mx.array, name: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, name
    assert mx.array_equal(got, want).item(), name


@pytest.mark.parametrize("sizes", [[], [(64, 48)], [(64, 64), (96, 64)]])
def test_the_merge_equals_the_model_code(models, sizes):
    loaded, plain = models
    assert isinstance(loaded.model.vision_tower, glm4v_tower.HostGridTower)
    if sizes and cuda_available() and plain.language_model.model.embed_tokens.weight.dtype == mx.bfloat16:
        # The reference cannot run there: mlx-vlm's tower attends over empty pieces of
        # its sequence, which in bfloat16 ends the process (SIGFPE). The engine's tower
        # runs there (test_no_attention_piece_is_empty).
        pytest.skip("mlx-vlm's GLM-4V tower in bfloat16 on CUDA ends the process (SIGFPE)")
    images = [make_image(w, h, seed) for seed, (w, h) in enumerate(sizes)]
    ids, inputs = prompt_inputs(loaded, images)
    embeds, kwargs = loaded.family.embed(ids, inputs)
    rest = dict(inputs)
    pixels, mask = rest.pop("pixel_values", None), rest.pop("attention_mask", None)
    grid = rest.get("image_grid_thw")
    _assert_equal(embeds, plain.get_input_embeddings(ids, pixels, mask=mask, **rest).inputs_embeds, "embeddings")
    if grid is None:  # text: the plain positions the model code's prefill uses
        return
    positions, deltas = plain.language_model.get_rope_index(ids, grid, None, None)
    _assert_equal(kwargs["position_ids"], positions, "position_ids")
    _assert_equal(kwargs["rope_deltas"], deltas, "rope_deltas")
    # The same from the images' features handed back, as the vision cache does.
    without_pixels = {k: v for k, v in inputs.items() if k != "pixel_values"}
    features = loaded.family.encode_images(ids, pixels, without_pixels)
    again, again_kwargs = loaded.family.embed(ids, without_pixels, features=features)
    _assert_equal(again, embeds, "embeddings from features")
    _assert_equal(again_kwargs["position_ids"], positions, "position_ids from features")


def test_embedding_a_prompt_waits_for_no_queued_work(models):
    """The tower call, the merge and the row's rope delta are all built while work
    queued before them still runs. The model code waits for all of it."""
    loaded, _ = models
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 7), make_image(48, 64, 8)])
    assert_embeds_without_waiting(loaded.family, ids, inputs)


def test_no_attention_piece_is_empty(models, monkeypatch):
    """The tower's attention goes over the model code's pieces of its sequence (the
    first image, the second, the rest) but never over an empty one, which in bfloat16
    on CUDA ends the process: one image, two, three."""
    loaded, _ = models
    lengths, attention = [], mx.fast.scaled_dot_product_attention

    def recorded(q, k, v, **kwargs):
        lengths.append(q.shape[2])
        return attention(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", recorded)
    for count in (1, 2, 3):
        ids, inputs = prompt_inputs(loaded, [make_image(64, 48, seed) for seed in range(count)])
        mx.eval(loaded.family.embed(ids, inputs)[0])
    depth = len(loaded.model.vision_tower.blocks)
    assert len(lengths) == depth * (1 + 2 + 3) and min(lengths) > 0  # 3 images: 3 pieces
