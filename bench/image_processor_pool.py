"""Whether a process pool would spare the image processor the interpreter-lock waits: one
call through a spawned child (the processor loaded there once, the image pickled there
and the pixels back), alone and beside a thread running Python, against the same call on
a thread, as the server makes it.

    python bench/image_processor_pool.py DIR
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
from alternating import median_ms, start_busy_thread
from PIL import Image

_processor = None  # the child's image processor


def _load_in_child(path: str) -> None:
    global _processor
    from mlx_vlm.utils import load_processor

    from vlm_serve.preprocess import fast_pixels

    _processor = load_processor(Path(path)).image_processor
    fast_pixels.install(_processor)


def _call_in_child(image: Image.Image) -> dict:
    out = _processor(images=[image], return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


def main() -> None:
    from vlm_serve.engine.loader import load

    path = sys.argv[1]
    processor = load(path).processor.image_processor
    pool = ProcessPoolExecutor(1, mp.get_context("spawn"), initializer=_load_in_child, initargs=(path,))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (896, 896, 3), dtype=np.uint8))
    expected = np.asarray(processor(images=[image], return_tensors="np")["pixel_values"])
    got = np.ascontiguousarray(pool.submit(_call_in_child, image).result()["pixel_values"])
    print("same bits:", np.array_equal(expected.view(np.uint8), got.view(np.uint8)))
    ways = {"in-thread": lambda: processor(images=[image], return_tensors="np"),
            "child process": lambda: pool.submit(_call_in_child, image).result()}
    for label in ("alone", "beside a busy thread"):
        if label != "alone":
            start_busy_thread()
        medians = median_ms(ways, 12)
        print(label, ", ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items()))
    pool.shutdown()


if __name__ == "__main__":
    main()
