"""Pixels handed to the worker as uint8 values and a table (``preprocess/packed_pixels.py``,
``engine/model_inputs.py``): in every family, the worker's arrays for a request are the
very floats its processor makes, bit for bit, whether its image processor packs or not."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_vlm import load as vlm_load

from conftest import data_url, make_image
from vlm_serve.engine.loader import resolve_chat_template
from vlm_serve.engine.model_inputs import model_arrays
from vlm_serve.engine.types import SamplingParams
from vlm_serve.fixtures.build import ARCHS, cached_model
from vlm_serve.preprocess import packed_pixels
from vlm_serve.preprocess.image_cache import ImageCache
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, load_chat_image, prepare_prompt, render_chat

# Image processors that stop at uint8 values: each resizes, rescales and normalizes, and
# nothing after. Idefics3's and SmolVLM's pad images to a common size after normalizing,
# with zeros no value becomes, so they hand floats.
PACKING = {"gemma3", "llava", "paligemma"}


def _prepared(arch: str, packed: bool, monkeypatch, cache: ImageCache | None = None):
    """A two-image chat (one where the model takes one), its images loaded as the chat
    route loads them, prepared on a freshly loaded processor with packing on or off."""
    monkeypatch.setattr(packed_pixels, "ENABLED", packed)
    path = cached_model(arch)
    _, processor = vlm_load(str(path))
    ctx = PromptContext(processor, arch, MediaPolicy(), 4, resolve_chat_template(path, processor),
                        image_cache=cache)
    urls = [data_url(make_image(64, 48, 1)), data_url(make_image(40, 72, 2), "JPEG")][: ctx.max_images]
    images = [load_chat_image(ctx, (url, "p", None), None) for url in urls]
    content = [{"type": "image"}] * len(images) + [{"type": "text", "text": "What is in these?"}]
    prompt = render_chat(ctx, [{"role": "user", "content": content}])
    return prepare_prompt(ctx, "r", prompt, SamplingParams(max_tokens=1), images)


def _bits(array: mx.array) -> tuple:
    host = np.ascontiguousarray(np.array(array))
    return host.dtype, host.shape, host.view(np.uint8).tobytes()


def _assert_same_arrays(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        pairs = zip(got[name], value) if isinstance(value, list) else [(got[name], value)]
        assert not isinstance(value, list) or len(got[name]) == len(value), name
        for x, y in pairs:
            assert _bits(x) == _bits(y), name


@pytest.mark.parametrize("arch", ARCHS)
def test_the_worker_gets_the_processors_own_floats(arch, monkeypatch):
    packed, floats = _prepared(arch, True, monkeypatch), _prepared(arch, False, monkeypatch)
    assert floats.pixel_table is None
    assert (packed.pixel_table is not None) == (arch in PACKING)
    if arch in PACKING:
        pixels = packed.model_inputs["pixel_values"]
        assert pixels.dtype == np.uint8 and pixels.nbytes * 4 == floats.model_inputs["pixel_values"].nbytes
    _assert_same_arrays(model_arrays(packed), model_arrays(floats))


def test_a_resent_image_is_served_packed_from_the_image_cache(monkeypatch):
    """The image cache keeps the uint8 values (a quarter of the floats' bytes) and hands
    the same array to every request with the image."""
    cache = ImageCache(16, 1 << 30)
    first = _prepared("gemma3", True, monkeypatch, cache)
    second = _prepared("gemma3", True, monkeypatch, cache)
    assert cache.hits > 0
    pixels = first.model_inputs["pixel_values"]
    assert pixels.dtype == np.uint8 and np.shares_memory(pixels, second.model_inputs["pixel_values"])
    _assert_same_arrays(model_arrays(second), model_arrays(_prepared("gemma3", False, monkeypatch)))


def test_the_table_is_each_values_float_through_the_image_processor(monkeypatch):
    """Every (channel, value) of Gemma 3's table is what its image processor makes of an
    image of that one value: the lookup holds for values no probe image had."""
    monkeypatch.setattr(packed_pixels, "ENABLED", True)
    _, processor = vlm_load(str(cached_model("gemma3")))
    table = packed_pixels.table_for(processor)
    from PIL import Image

    for value in (0, 1, 127, 128, 254, 255):
        color = (value, 255 - value, (value * 7) % 256)
        image = Image.new("RGB", (20, 30), color)
        pixels = np.asarray(processor.image_processor(images=[image], return_tensors="np")["pixel_values"])
        for channel in range(3):
            assert np.all(pixels[:, channel] == table[channel, color[channel]])
