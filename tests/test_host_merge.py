"""LLaVA, InternVL and Mistral 3 put their images' features into the prompt's embeddings
at positions found on the host (``families/host_merge.py``), not by the model code's
reads of device arrays, each of which waits for all queued device work. The embeddings
equal the model code's (a second copy of the model, as mlx-vlm loads it) to the bit,
and embedding a prompt waits for no work queued before it."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from vlm_serve.engine.families import family_for, host_merge
from vlm_serve.engine.loader import load

from conftest import make_image, prompt_inputs, time_behind_queued_work

ARCHS = ["llava", "internvl_chat", "mistral3"]


@pytest.fixture(scope="module", params=ARCHS)
def models(request, model_path):
    """(the engine's copy, with its family, and mlx-vlm's own copy) of one model."""
    loaded = load(str(model_path(request.param)))
    loaded.family = family_for(loaded.model)
    return loaded, load(str(model_path(request.param))).model


def test_the_merge_equals_the_model_code(models):
    loaded, plain = models
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 1)])
    embeds, _ = loaded.family.embed(ids, inputs)
    rest = dict(inputs)
    pixels, mask = rest.pop("pixel_values"), rest.pop("attention_mask", None)
    expected = plain.get_input_embeddings(ids, pixels, mask=mask, **rest).inputs_embeds
    assert embeds.dtype == expected.dtype and embeds.shape == expected.shape
    assert mx.array_equal(embeds, expected).item()
    image_token = getattr(plain.config, "image_token_index", None)
    assert image_token is not None and (np.asarray(ids) == image_token).any(), "the prompt holds image tokens"


def test_pixtrals_block_mask_equals_its_own():
    from mlx_vlm.models.pixtral import vision

    host_merge._install_block_mask()
    original = host_merge._block_mask.original
    tensor = mx.zeros((2, 23, 8), mx.bfloat16)
    for blocks in ([23], [6, 12, 5], [1, 22]):
        assert mx.array_equal(vision.generate_block_attention_mask(blocks, tensor), original(blocks, tensor)).item()


def test_embedding_a_prompt_waits_for_no_queued_work(models):
    """The model code's merge waits for all the work queued before it."""
    loaded, _ = models
    ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 2)])
    mx.eval(loaded.family.embed(ids, inputs)[0])  # first use's setup, not timed
    spent, queued = time_behind_queued_work(lambda: loaded.family.embed(mx.array(np.asarray(ids)), inputs))
    assert spent < queued / 4, f"embedding took {spent:.2f} s behind {queued:.2f} s of queued work"
