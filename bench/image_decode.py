"""Decoding an uploaded image (PNG, JPEG), the server's way (``media.decode_image``: the
whole upload fed to the decoder at once) and Pillow's plain one (``Image.open``, ``load``,
RGB: 64 KB blocks), alone or beside a thread running Python, at Python's switch interval
or another: Pillow gives up the interpreter lock for every block it decodes, and a thread
beside it that runs Python holds the lock until the switch interval ends.

    python bench/image_decode.py [--size 896] [--busy-thread] [--switch-intervals 0.005,0.001]
"""

from __future__ import annotations

import argparse
import io
import sys

import numpy as np
from alternating import median_ms, start_busy_thread
from PIL import Image

from vlm_serve.preprocess.media import MediaPolicy, decode_image


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=896)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--busy-thread", action="store_true")
    p.add_argument("--switch-intervals", default="0.005", help="seconds, comma-separated")
    args = p.parse_args()
    pixels = np.random.default_rng(0).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)
    encoded = {}
    for fmt in ("PNG", "JPEG"):
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format=fmt)
        encoded[fmt] = buf.getvalue()
    if args.busy_thread:
        start_busy_thread()
    for interval in (float(s) for s in args.switch_intervals.split(",")):
        sys.setswitchinterval(interval)
        for fmt, data in encoded.items():
            ways = {"Pillow's": lambda: Image.open(io.BytesIO(data)).convert("RGB"),
                    "the server's": lambda: decode_image(data, MediaPolicy())}
            medians = median_ms(ways, args.repeats)
            print(f"switch interval {1000 * interval:g} ms, {fmt} of {len(data) / 1e6:.1f} MB: "
                  + ", ".join(f"{name} {ms:.1f} ms" for name, ms in medians.items())
                  + f" (median of {args.repeats})" + (", beside a busy thread" if args.busy_thread else ""),
                  flush=True)


if __name__ == "__main__":
    main()
