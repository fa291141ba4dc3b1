"""Pixels handed to the worker as the image processor's uint8 values, to the bit.

An image processor resizes an image in uint8, then rescales and normalizes each value
to a float: the float depends only on the value and its channel. So the CPU pool has
the image processor stop after resizing (``do_rescale=False, do_normalize=False``) and
hands the worker those uint8 pixels with a table of the float each (channel, value)
becomes, made by the image processor's own rescale and normalize. The worker looks
them up on the device (``engine.model_inputs``).

A 896-pixel image is then 2.4 MB to copy to the device instead of 9.6 MB of float32:
on a GPU host that copy was ~7 ms of the worker's time per image, in a burst of image
requests while the device waited. The pool skips the two float passes too (19 -> 14 ms
of an image processor call on a CPU).

A check at startup runs the image processor both ways on two probe images of other
shapes for one prompt, and keeps the float pixels where the looked-up ones differ in
any bit or come in a layout other than channels-first images. An image processor that
pads images to a common size after normalizing keeps them too: its padding is zeros,
which no value becomes.
"""

from __future__ import annotations

import copy
import logging
import os

import numpy as np
from PIL import Image

from .fast_pixels import processed_pixels

log = logging.getLogger(__name__)

# VLM_SERVE_PACKED_PIXELS=0 hands the worker float pixels, as the processor makes them.
ENABLED = os.environ.get("VLM_SERVE_PACKED_PIXELS", "1") != "0"

# What the image processor is called with so that it stops at the uint8 values.
STOP_AT_UINT8 = {"do_rescale": False, "do_normalize": False}

_TABLE_ATTR = "_vlm_serve_pixel_table"


def table_for(processor) -> np.ndarray | None:
    """The (channels, 256) table of the float each (channel, uint8 value) becomes in
    ``processor``'s pixels, where its image processor can hand uint8 pixels instead
    (checked once per image processor); None where it cannot."""
    images = getattr(processor, "image_processor", None)
    if not ENABLED or images is None:
        return None
    if not hasattr(images, _TABLE_ATTR):
        table = _checked_table(images)
        setattr(images, _TABLE_ATTR, table)
        if table is not None:
            log.info("%s: pixels handed to the worker as uint8 values and a table of %d channels",
                     type(images).__name__, table.shape[0])
    return getattr(images, _TABLE_ATTR)


def packing(processor):
    """A shallow copy of ``processor`` whose image processor stops at the uint8 values
    (use where ``table_for`` gave a table)."""
    clone = copy.copy(processor)
    clone.image_processor = _StopAtUint8(processor.image_processor)
    return clone


def is_packed(pixels) -> bool:
    """Whether a processor output's pixels are uint8 values (an array, or a list of
    them for images of different sizes)."""
    arrays = pixels if isinstance(pixels, list) else [pixels]
    return bool(arrays) and all(isinstance(a, np.ndarray) and a.dtype == np.uint8 for a in arrays)


def unpack(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """The floats of channels-first uint8 ``values`` (..., channels, height, width), on
    the CPU (the worker does the same on the device)."""
    return table[np.arange(table.shape[0]).reshape(-1, 1, 1), values]


class _StopAtUint8:
    """Stands in for an image processor: every call stops at the uint8 values; every
    other attribute is the real one's."""

    def __init__(self, image_processor):
        self._real = image_processor

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __call__(self, images, *args, **kwargs):
        return self._real(images, *args, **{**kwargs, **STOP_AT_UINT8})


def _checked_table(images) -> np.ndarray | None:
    try:
        if not (getattr(images, "do_rescale", False) and getattr(images, "do_normalize", False)):
            return None  # nothing to stop: its pixels are what they are
        if getattr(images, "do_pad", False):
            return None  # it may pad images after normalizing (see above)
        channels = len(np.atleast_1d(images.image_mean))
        table = _table(images, channels)
        # Two images of other shapes for one prompt: a processor that pads them to a
        # common size would show it here, whatever it calls the setting.
        rng = np.random.default_rng(0)
        probe = [[Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8))
                  for shape in ((37, 53, 3), (61, 29, 3))]]
        floats = processed_pixels(images, probe)
        values = processed_pixels(images, probe, **STOP_AT_UINT8)
    except Exception as exc:  # noqa: BLE001 - an image processor unlike the usual: floats
        log.info("%s: float pixels handed to the worker (%s)", type(images).__name__, exc)
        return None
    same = (values.dtype == np.uint8 and values.ndim >= 3 and values.shape[-3] == channels
            and floats.dtype == table.dtype and floats.shape == values.shape
            and np.array_equal(unpack(values, table).view(np.uint8), floats.view(np.uint8)))
    if not same:
        log.info("%s: float pixels handed to the worker (its uint8 values and a table "
                 "do not give its pixels)", type(images).__name__)
        return None
    return table


def _table(images, channels: int) -> np.ndarray:
    """Every uint8 value in every channel through the image processor's own rescale and
    normalize, as a channels-first image of one row."""
    values = np.ascontiguousarray(np.broadcast_to(np.arange(256, dtype=np.uint8), (channels, 1, 256)))
    scaled = images.rescale(values, scale=images.rescale_factor)
    normalized = images.normalize(scaled, mean=images.image_mean, std=images.image_std)
    return np.ascontiguousarray(np.asarray(normalized).reshape(channels, 256))
