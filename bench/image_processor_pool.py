"""Whether a process pool would spare the image processor the interpreter-lock waits: one
call through a spawned child (the processor loaded there once, the image pickled there
and the pixels back), alone and beside a thread running Python, against the same call on
a thread, as the server makes it.

    python bench/image_processor_pool.py DIR
"""
import multiprocessing as mp, statistics, sys, threading, time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
import numpy as np
from PIL import Image

_ip = None

def _init(path):
    global _ip
    from mlx_vlm.utils import load_processor
    from vlm_serve.preprocess import fast_pixels
    _ip = load_processor(Path(path)).image_processor
    fast_pixels.install(_ip)

def _call(image):
    out = _ip(images=[image], return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}

def spin():
    n = 0
    while True:
        n += 1

if __name__ == "__main__":
    path = sys.argv[1]
    from vlm_serve.engine.loader import load
    ip = load(path).processor.image_processor
    pool = ProcessPoolExecutor(1, mp.get_context("spawn"), initializer=_init, initargs=(path,))
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (896, 896, 3), dtype=np.uint8))
    ref = np.asarray(ip(images=[img], return_tensors="np")["pixel_values"])
    got = pool.submit(_call, img).result()["pixel_values"]
    print("same bits:", np.array_equal(ref.view(np.uint8), np.ascontiguousarray(got).view(np.uint8)))
    ways = {"in-thread": lambda: ip(images=[img], return_tensors="np"),
            "child process": lambda: pool.submit(_call, img).result()}
    for label in ("alone", "busy"):
        if label == "busy":
            threading.Thread(target=spin, daemon=True).start()
        times = {n: [] for n in ways}
        for _ in range(12):
            for n, f in ways.items():
                s = time.perf_counter(); f(); times[n].append(1000 * (time.perf_counter() - s))
        print(label, ", ".join(f"{n} {statistics.median(t):.1f} ms" for n, t in times.items()))
    pool.shutdown()
