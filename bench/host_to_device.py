"""Host time to turn a request's pixels into an ``mx.array`` (``Prefill.materialize``)
and for the device to read them: an 896x896 image as the processor gives it (float32),
as bfloat16 bits (half the bytes; what the tower casts it to in a bf16 model) and as
uint8 (a quarter: the pixels before rescaling). On CUDA, MLX keeps arrays in managed
memory: in a burst on an H200 the float32 conversion took ~7 ms of the worker's CPU an
image, against 0.8 ms on a CPU (``bench/results/gpu-h200-burst-timeline``).

    python bench/host_to_device.py [--size 896] [--repeat 20]

Per form: the median of ``mx.array`` (host), and of evaluating a sum over it after
(the device reading it), in ms.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np


def forms(size: int) -> dict[str, tuple[np.ndarray, object]]:
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((1, 3, size, size), dtype=np.float32)
    bits = pixels.view(np.uint32)
    bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    as_uint8 = rng.integers(0, 255, (1, size, size, 3), dtype=np.uint8)
    return {"float32": (pixels, None), "bfloat16 bits": (bf16, mx.bfloat16), "uint8": (as_uint8, None)}


def time_form(array: np.ndarray, view, repeat: int) -> tuple[float, float]:
    host, device = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        x = mx.array(array)
        if view is not None:
            x = x.view(view)
        host.append(time.perf_counter() - t)
        t = time.perf_counter()
        mx.eval(x.astype(mx.float32).sum())
        device.append(time.perf_counter() - t)
    return 1000 * statistics.median(host), 1000 * statistics.median(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=896)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args()
    print(f"device {mx.default_device()}, MLX {mx.__version__}, {args.size}x{args.size} image")
    for name, (array, view) in forms(args.size).items():
        host, device = time_form(array, view, args.repeat)
        print(f"{name:14s} {array.nbytes / 1e6:5.1f} MB: mx.array {host:6.2f} ms, device read {device:6.2f} ms")


if __name__ == "__main__":
    main()
