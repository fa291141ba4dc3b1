"""Faster rescaling and normalizing of an image's pixels, to the bit.

transformers' PIL-backend image processors rescale and normalize with its NumPy
functions (``image_transforms.rescale``, ``normalize``) on the channels-first view of a
channels-last image: strided loops over a float64 copy, and transposes. For one
896-pixel image that is ~10 ms of a ~20 ms image processor call on a 2-core CI machine,
paid by every new image of every request (and by a burst of them together).

Each output value depends only on its input value and its channel. So here:

- rescaling a uint8 image looks each value up in a 256-entry table made by the same
  arithmetic (the value as float64, times the scale, rounded to float32);
- normalizing a float32 channels-first image subtracts the channel's mean and divides
  by its std in float32, as transformers does, with the mean and std broadcast along
  the channels instead of the image transposed.

The same IEEE operation on each value gives the same bits. A check at install runs the
image processor on a random image with and without these, and keeps it as it was where
the pixels differ in any bit (another transformers' arithmetic, say).
"""

from __future__ import annotations

import logging
import os
from functools import lru_cache

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

# VLM_SERVE_FAST_PIXELS=0 leaves every image processor as transformers made it (for comparison).
ENABLED = os.environ.get("VLM_SERVE_FAST_PIXELS", "1") != "0"


def install(image_processor) -> bool:
    """Give ``image_processor`` (a processor's ``image_processor``) the faster rescale
    and normalize where it uses transformers' NumPy ones and they give its exact pixels.
    Returns whether it did (again: True)."""
    if getattr(image_processor, "_fast_pixels", False):
        return True
    if not (ENABLED and _uses_numpy_transforms(image_processor)):
        return False
    probe = Image.fromarray(np.random.default_rng(0).integers(0, 256, (37, 53, 3), dtype=np.uint8))
    try:
        before = processed_pixels(image_processor, [probe])
        image_processor.rescale = _rescale_with(image_processor.rescale)
        image_processor.normalize = _normalize_with(image_processor.normalize)
        after = processed_pixels(image_processor, [probe])
    except Exception as exc:  # noqa: BLE001 - a processor unlike the usual: leave it be
        _uninstall(image_processor)
        log.info("%s: pixels processed as transformers does (%s)", type(image_processor).__name__, exc)
        return False
    if not (before.dtype == after.dtype and before.shape == after.shape
            and np.array_equal(before.view(np.uint8), after.view(np.uint8))):
        _uninstall(image_processor)
        log.warning("%s: the faster rescale and normalize change its pixels; not used",
                    type(image_processor).__name__)
        return False
    image_processor._fast_pixels = True
    return True


def _uses_numpy_transforms(image_processor) -> bool:
    try:
        from transformers.image_processing_backends import PilBackend
    except ImportError:  # a transformers without the PIL backend class
        return False
    cls = type(image_processor)
    return (isinstance(image_processor, PilBackend) and cls.rescale is PilBackend.rescale
            and cls.normalize is PilBackend.normalize)


def processed_pixels(image_processor, images: list, **kwargs) -> np.ndarray:
    """The pixels ``image_processor`` makes of ``images`` (with ``kwargs``), as one
    contiguous array."""
    out = image_processor(images=images, return_tensors="np", **kwargs)
    pixels = out["pixel_values"] if "pixel_values" in out else out["images"]
    return np.ascontiguousarray(np.asarray(pixels))


def _uninstall(image_processor) -> None:
    for name in ("rescale", "normalize"):
        image_processor.__dict__.pop(name, None)


@lru_cache(maxsize=8)
def _rescale_table(scale: float) -> np.ndarray:
    return (np.arange(256, dtype=np.float64) * scale).astype(np.float32)


def _rescale_with(original):
    def rescale(image, scale, **kwargs):
        if kwargs or not isinstance(image, np.ndarray) or image.dtype != np.uint8:
            return original(image=image, scale=scale, **kwargs)
        return np.take(_rescale_table(float(scale)), image)

    return rescale


def _normalize_with(original):
    def normalize(image, mean, std, **kwargs):
        if kwargs or not isinstance(image, np.ndarray) or image.ndim != 3 or image.dtype != np.float32:
            return original(image=image, mean=mean, std=std, **kwargs)
        means, stds = _per_channel(mean, image.shape[0]), _per_channel(std, image.shape[0])
        if means is None or stds is None:  # transformers raises for these
            return original(image=image, mean=mean, std=std, **kwargs)
        out = image - means
        out /= stds
        return out

    return normalize


def _per_channel(value, channels: int) -> np.ndarray | None:
    """A mean or std as transformers takes it (one for all channels, or one each), as a
    float32 column to broadcast over a channels-first image; None where the count is wrong."""
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value] * channels
    return np.array(values, np.float32).reshape(-1, 1, 1) if len(values) == channels else None
