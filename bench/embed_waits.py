"""How long a family's prompt embedding waits behind device work queued before it.

For each architecture's tiny fixture: one image prompt is embedded as the engine embeds
it (``Family.embed``, features from the family's own tower call where it has one, else
the model code's tower), just after a chain of matmuls was queued with
``mx.async_eval``. An embedding that reads anything back from the device waits for all
of that work; one that does not returns at once. Prints one line per architecture.

    python bench/embed_waits.py [ARCH ...]    # default: every fixture architecture
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import make_image, prompt_inputs  # noqa: E402
from vlm_serve.engine.families import family_for  # noqa: E402
from vlm_serve.engine.loader import load  # noqa: E402
from vlm_serve.fixtures.build import ARCHS, cached_model  # noqa: E402


def queued_work() -> mx.array:
    x = mx.random.normal((1024, 1024), key=mx.random.key(0))
    y = x
    for _ in range(8):
        y = (y @ x) / 1024
    return y


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("archs", nargs="*", default=ARCHS)
    args = p.parse_args()
    start = time.perf_counter()
    mx.eval(queued_work())
    work = time.perf_counter() - start
    print(f"queued work alone: {work:.2f} s")
    for arch in args.archs:
        loaded = load(str(cached_model(arch)))
        loaded.family = family = family_for(loaded.model)
        ids, inputs = prompt_inputs(loaded, [make_image(64, 48, 1)], "What?")
        rest = {k: v for k, v in inputs.items() if k != "pixel_values"}
        features = family.encode_images(ids, inputs["pixel_values"], rest)
        args_ = (rest, ("key",), features) if features is not None else (inputs, (), None)
        mx.eval(family.embed(ids, *args_)[0])  # first use's setup, not timed
        queued = queued_work()
        mx.async_eval(queued)
        start = time.perf_counter()
        family.embed(ids, *args_)
        spent = time.perf_counter() - start
        mx.eval(queued)
        tower = "family's tower call" if features is not None else "tower inside the merge"
        print(f"{arch}: {spent:.3f} s ({tower})", flush=True)


if __name__ == "__main__":
    main()
