"""How many images may share a vision-tower call on CUDA, each keeping its bits.

On the CPU an image's features are the same in a tower call with other images as in a
call of its own (the parity suite's burst cases prove it). MLX's CUDA kernels for
convolutions and matmuls are chosen by a call's shapes, the number of images among
them, so there an image may round otherwise in company. So on CUDA, the first time
requests with images of one shape would share a call, a check runs: calls of each size
in ``SIZES``, of random images of that shape, against each image alone. Requests of
one image each are then cut into calls of the sizes at which every image kept its
bits; a request of several images, and one that no checked size takes, gets a call of
its own, as it would alone. The kernels are chosen by shape, never by values, so what
held for random pixels holds for any of that shape.

Only for families whose shared call stacks whole images of one shape
(``Family.tower_stacks_images``): a call's shape is then its number of images.
"""

from __future__ import annotations

import logging
import os

import mlx.core as mx
import numpy as np

log = logging.getLogger("vlm_serve.engine")

# VLM_SERVE_SHARE_TOWERS=0: on CUDA each request's images get a call of their own (for
# comparison).
ENABLED = os.environ.get("VLM_SERVE_SHARE_TOWERS", "1") != "0"
# Call sizes checked: a prefill turn starts about as many image requests as fit its token
# budget (seven 896-pixel Gemma 3 chats in 2,048 tokens).
SIZES = tuple(range(2, 9))


class TowerSharing:
    def __init__(self, family):
        self.family = family
        self.checked: dict[tuple, tuple[int, ...]] = {}  # (shape, dtype) -> sizes that kept bits

    def calls(self, inputs: list[dict]) -> list[list[int]]:
        """Indices of one-image requests' tower ``inputs`` (all of one shape) that share
        a call, a list per call; the rest are left out (each calls the tower alone)."""
        singles = [i for i, x in enumerate(inputs) if x["pixel_values"].shape[0] == 1]
        if len(singles) < 2:
            return []
        sizes = self.sizes(inputs[singles[0]]["pixel_values"])
        out = []
        for size in cut(len(singles), sizes):
            if size > 1:
                out.append(singles[:size])
            singles = singles[size:]
        return out

    def sizes(self, pixels: mx.array) -> tuple[int, ...]:
        """Call sizes at which images like ``pixels`` (one image's tower input) keep
        their bits, checked once per shape."""
        key = (tuple(pixels.shape), str(pixels.dtype))
        if key not in self.checked:
            try:
                kept = self._check(pixels.shape, pixels.dtype)
            except Exception:  # noqa: BLE001 - out of memory at 8 images, say: share nothing
                log.warning("vision tower, images of shape %s: the check failed; each request "
                            "calls it alone", key[0], exc_info=True)
                self.checked[key] = ()
                return ()
            self.checked[key] = kept
            differing = [n for n in SIZES if n not in kept]
            log.info("vision tower, images of shape %s: %s", key[0],
                     f"calls of {_spans(kept)} images keep each image's bits" if kept else
                     "no shared call kept every image's bits: each request calls it alone")
            if kept and differing:
                log.info("vision tower, images of shape %s: calls of %s images would round them "
                         "otherwise and are not made", key[0], _spans(differing))
        return self.checked[key]

    def _check(self, shape: tuple, dtype) -> tuple[int, ...]:
        family = self.family
        rng = np.random.default_rng(0)
        images = [{"pixel_values": mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)}
                  for _ in range(max(SIZES))]
        ids = mx.zeros((1, 1), mx.int32)  # the tower reads only the embedding dtype from it

        def encode(batch: list[dict]) -> list[mx.array]:
            stacked = family.stack_image_inputs(batch) if len(batch) > 1 else batch[0]
            features = family.encode_images(ids, stacked["pixel_values"], stacked)
            return family.split_image_features(features, batch) if len(batch) > 1 else [features]

        alone = [encode([image])[0] for image in images]
        mx.eval(alone)
        kept = []
        for size in SIZES:
            shared = encode(images[:size])
            if all(mx.array_equal(a, b).item() for a, b in zip(alone, shared)):
                kept.append(size)
        return tuple(kept)


def cut(count: int, sizes: tuple[int, ...]) -> list[int]:
    """``count`` one-image requests as calls of the given ``sizes``, largest first; a
    remainder that no size takes goes alone (calls of one)."""
    calls = []
    while count > 1:
        fitting = [s for s in sizes if s <= count]
        if not fitting:
            break
        calls.append(max(fitting))
        count -= calls[-1]
    return calls + [1] * count


def _spans(sizes) -> str:
    """2, 3, 4, 8 -> "2-4, 8"."""
    runs: list[list[int]] = []
    for n in sizes:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
