"""The faster rescale and normalize (``preprocess/fast_pixels.py``) give transformers'
pixels to the bit: each model's own image processor, loaded as the server loads it,
against a copy loaded by mlx-vlm alone, on images of several sizes and modes."""

from __future__ import annotations

import numpy as np
import pytest
from mlx_vlm import load as vlm_load
from PIL import Image

from vlm_serve.engine.loader import load
from vlm_serve.fixtures.build import cached_model
from vlm_serve.preprocess import fast_pixels

# Families whose image processors are transformers' PIL-backend ones.
ARCHS = ["gemma3", "llava", "idefics3", "paligemma", "mllama", "glm4v", "smolvlm"]


def _images() -> list[Image.Image]:
    rng = np.random.default_rng(3)
    rgb = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in
           [(37, 53), (224, 224), (300, 420), (896, 896)]]
    gray = Image.fromarray(rng.integers(0, 256, (64, 80), dtype=np.uint8), "L").convert("RGB")
    rgba = Image.fromarray(rng.integers(0, 256, (50, 70, 4), dtype=np.uint8), "RGBA").convert("RGB")
    return rgb + [gray, rgba]


def _pixels(image_processor, image) -> np.ndarray:
    out = image_processor(images=[image], return_tensors="np")
    return np.ascontiguousarray(np.asarray(out["pixel_values"]))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_server_processor_gives_transformers_pixels_to_the_bit(arch):
    path = str(cached_model(arch))
    served = load(path).processor.image_processor
    assert served._fast_pixels  # installed, so what follows compares the two ways
    _, plain = vlm_load(path)
    reference = plain.image_processor
    assert not getattr(reference, "_fast_pixels", False)
    for image in _images():
        want, got = _pixels(reference, image), _pixels(served, image)
        assert want.dtype == got.dtype and want.shape == got.shape
        assert np.array_equal(want.view(np.uint8), got.view(np.uint8)), image.size


def test_a_processor_whose_pixels_would_change_is_left_as_it_was(monkeypatch):
    """As with a transformers whose arithmetic differs (here, a rescale table one step
    off in its last bit): the check at install refuses, and the processor keeps its own
    rescale and normalize."""
    _, processor = vlm_load(str(cached_model("gemma3")))
    image_processor = processor.image_processor
    fast_pixels._rescale_table.cache_clear()
    monkeypatch.setattr(fast_pixels, "_rescale_table",
                        lambda scale: np.nextafter(np.arange(256, dtype=np.float32) * np.float32(scale),
                                                   np.float32(2)))
    assert fast_pixels.install(image_processor) is False
    assert "rescale" not in vars(image_processor) and "normalize" not in vars(image_processor)
    assert not getattr(image_processor, "_fast_pixels", False)


def test_turned_off_the_processor_keeps_transformers_arithmetic(monkeypatch):
    """VLM_SERVE_FAST_PIXELS=0 (read at import, set here on the module)."""
    monkeypatch.setattr(fast_pixels, "ENABLED", False)
    _, processor = vlm_load(str(cached_model("gemma3")))
    assert fast_pixels.install(processor.image_processor) is False
    assert "rescale" not in vars(processor.image_processor)
