"""Images already loaded and processed, so a resent image skips the work.

Chat clients resend the whole conversation every turn, base64 image included. Each
image gets a *source key*: a digest of what the client sent (a data URL's text, or the
fetched bytes) plus the settings that change what the processor sees (``detail``,
``--min-image-pixels``). The same key always means the same pixels, and another image
always means another key, so it doubles as the image's digest for the prefix and
vision caches (no second hash of the pixels). Two kinds of entries share one
least-recently-used budget of entries and bytes:

- an image's source key -> the decoded, resized RGB image the processor is given;
- the keys of a processor call's images, in order -> the image processor's output for
  them, served to the model's own processor through a proxy (``CachingProcessor``),
  so its text handling (placeholder expansion, tokenizing) runs as always.

mlx-vlm's own processors end by converting their outputs to MLX arrays, which
``tokenize`` turns straight back into numpy (the worker alone makes MLX arrays): two
copies of every pixel, ~5 ms of a resent 896 px image's turn on a GPU host. Their
pixels are handed through as ``HeldArray``: that conversion keeps an object it does not
know as it is, and ``np.asarray`` takes the array back out.
"""

from __future__ import annotations

import copy
import hashlib
import logging

import numpy as np
from PIL import Image

from ..lru import SizedLRU

log = logging.getLogger(__name__)

try:  # BLAKE3 hashes a resent multi-megabyte data URL in a third of SHA-256's time
    from blake3 import blake3 as _blake3
except ImportError:  # not installed: the standard library's
    _blake3 = None

# Sources at least this long are hashed on several threads (BLAKE3's tree splits them;
# the digest is the same): a multi-megabyte data URL is on every turn of an image chat.
_THREADED_HASH_BYTES = 1 << 20


def _content_hash(source: bytes):
    if _blake3 is None:
        return hashlib.sha256(source)
    if len(source) >= _THREADED_HASH_BYTES:
        return _blake3(source, max_threads=_blake3.AUTO)
    return _blake3(source)

# The source key rides on the PIL image object itself: an attribute (unlike
# ``image.info``) is not copied onto images derived from it by convert/resize/copy.
_KEY_ATTR = "_vlm_serve_source_key"


def source_key(kind: str, source: bytes, settings: str) -> str:
    """The key of an image from its source (``kind`` names what ``source`` is, so a
    data URL's text and fetched bytes never compare equal) and the ``settings`` that
    shape the image the processor gets from it. The hash is a cryptographic one: a
    client must not be able to make another image's key (and so its cached KV)."""
    return f"{kind}:{_content_hash(source).hexdigest()}:{settings}"


def tag(image: Image.Image, key: str) -> Image.Image:
    setattr(image, _KEY_ATTR, key)
    return image


def key_of(image) -> str | None:
    """The source key of an image loaded from a request, or None (an image made
    in-process, e.g. by a test or the warm-up)."""
    return getattr(image, _KEY_ATTR, None)


class ImageCache(SizedLRU):
    """Loaded and processed images, bounded by entries and bytes (``--image-cache-size``,
    ``--image-cache-gb``)."""


def image_bytes(image: Image.Image) -> int:
    return image.width * image.height * len(image.getbands())


class HeldArray:
    """A processed image's pixels on their way through a processor, untouched (see the
    module's description); ``np.asarray`` gives the array itself."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array

    def __array__(self, dtype=None, copy=None):
        array = self.array if dtype is None else self.array.astype(dtype)
        return array.copy() if copy else array

    def __getattr__(self, name):  # shape, dtype, tolist ... of the array
        return getattr(self.array, name)

    def __len__(self) -> int:
        return len(self.array)

    def __getitem__(self, index):
        return self.array[index]


class CachingImageProcessor:
    """Stands in for a processor's image processor: a call whose images all carry
    source keys is answered from the cache (computed once, by the real one); anything
    else, and every other attribute, goes to the real one. ``hand_over``: its pixels
    are handed out as ``HeldArray``."""

    def __init__(self, image_processor, cache: ImageCache, hand_over: bool = False):
        self._real = image_processor
        self._cache = cache
        self.hand_over = hand_over

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __call__(self, images, *args, **kwargs):
        keys = [key_of(im) for im in _flatten(images)]
        if not keys or None in keys:
            return self._real(images, *args, **kwargs)
        # Arguments are part of the key; one whose repr is not stable (an object's
        # address) only makes the entry unreachable, never wrong.
        key = ("processed", self.hand_over, _nesting(images), tuple(keys), repr(args),
               repr(sorted(kwargs.items())))
        cached = self._cache.get(key)
        if cached is None:
            output = self._real(images, *args, **kwargs)
            if self.hand_over:
                output = _stacked(output)
            size = _frozen_size(output)
            if size is None:  # holds something we cannot safely share (e.g. MLX arrays)
                return output
            self._cache.put(key, output, size)
            cached = output
        return _fresh(cached, self.hand_over)


class CachingProcessor:
    """A shallow copy of the model's processor whose image processor is cached, used
    only for the processor calls of requests (the model's own object is left as is).
    ``None`` where the processor has no separate image processor to cache."""

    @staticmethod
    def wrap(processor, cache: ImageCache | None):
        real = getattr(processor, "image_processor", None)
        if cache is None or cache.max_entries <= 0 or not callable(real):
            return None
        # mlx-vlm's processors convert their outputs to MLX arrays, pixels included.
        hand_over = type(processor).__module__.startswith("mlx_vlm.")
        try:
            clone = copy.copy(processor)
            clone.image_processor = CachingImageProcessor(real, cache, hand_over)
        except Exception as exc:  # a processor that refuses copies: no processed cache
            log.info("processed images are not cached for %s: %s", type(processor).__name__, exc)
            return None
        return clone


def handing_over(processor) -> CachingImageProcessor | None:
    """The cached image processor of ``processor`` where it hands out held pixels."""
    images = getattr(processor, "image_processor", None)
    return images if isinstance(images, CachingImageProcessor) and images.hand_over else None


def _flatten(images) -> list:
    if isinstance(images, (list, tuple)):
        return [im for item in images for im in _flatten(item)]
    return [images]


def _nesting(images):
    """The list structure of ``images`` (batched differs from flat for some processors)."""
    if isinstance(images, (list, tuple)):
        return tuple(_nesting(item) for item in images)
    return None


def _frozen_size(value) -> int | None:
    """Bytes of the numpy arrays in an output, each made read-only so no caller can
    change a cached entry in place; None if it holds anything but plain data."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return None
        value.flags.writeable = False
        return value.nbytes
    if isinstance(value, (list, tuple)):
        sizes = [_frozen_size(v) for v in value]
        return None if None in sizes else sum(sizes)
    if hasattr(value, "keys") and hasattr(value, "items"):  # dict, BatchFeature
        sizes = [_frozen_size(v) for v in value.values()]
        return None if None in sizes else sum(sizes)
    if value is None or isinstance(value, (bool, int, float, str, np.generic)):
        return 0
    return None


def _stacked(output):
    """An image processor's output with each list of same-shaped pixel arrays stacked
    into one array, as mlx-vlm's conversion to MLX stacks it (a held list would not
    pass through that conversion)."""
    if not (hasattr(output, "keys") and hasattr(output, "items")):
        return output
    out = copy.copy(output)
    for k, v in out.items():
        if (isinstance(v, list) and v and all(isinstance(a, np.ndarray) and _is_pixels(a) for a in v)
                and len({(a.shape, a.dtype) for a in v}) == 1):
            out[k] = np.stack(v)
    return out


def _fresh(value, hold: bool = False):
    """A copy of a cached output that a caller may pop from or add to (processors do:
    Gemma 3's pops ``num_crops``); containers are copied, arrays shared read-only, and
    with ``hold`` pixels wrapped as ``HeldArray``."""
    if isinstance(value, list):
        return [_fresh(v, hold) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v, hold) for v in value)
    if hasattr(value, "keys") and hasattr(value, "items"):
        out = copy.copy(value)  # BatchFeature (a UserDict) copies its dict; a dict copies
        for k, v in out.items():
            out[k] = _fresh(v, hold)
        return out
    if hold and isinstance(value, np.ndarray) and _is_pixels(value):
        return HeldArray(value)
    return value


def _is_pixels(array: np.ndarray) -> bool:
    """Floats, or uint8 values where the image processor stops before rescaling
    (``packed_pixels``)."""
    return array.dtype.kind == "f" or array.dtype == np.uint8
