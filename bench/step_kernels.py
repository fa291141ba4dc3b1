"""GPU time of each kernel of the engine's decode step, under NVIDIA's ncu: two steps of
a batch of B ragged text rows (op by op, as the server builds steps past 64 slots) are
bracketed with the CUDA profiler's start and stop, so only they are profiled.

    ncu --profile-from-start off --metrics gpu__time_duration.sum --print-summary per-kernel \\
        --csv python bench/step_kernels.py --model DIR --batch 128 > kernels.csv
    python bench/step_kernels.py --summarize kernels.csv

``--prefill-length L`` profiles two prefill passes instead: ``--batch`` prompts of L
tokens each in one pass on fresh caches, through the family's engine decoder as the
scheduler runs a burst's shared pass; ``--tower-images N`` two vision-tower calls of N
images; ``--compiled`` the decode step compiled, as the server runs it up to 64 slots.
"""

from __future__ import annotations

import argparse
import collections
import csv
import ctypes
import logging
import os
import sys


def profiled(one, warm_up: int = 3) -> None:
    """Run ``one()`` (evaluated) ``warm_up`` times, then twice between the CUDA
    profiler's start and stop."""
    import mlx.core as mx

    for _ in range(warm_up):
        mx.eval(one())
    mx.synchronize()
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuProfilerStart()
    for _ in range(2):
        mx.eval(one())
    mx.synchronize()
    cuda.cuProfilerStop()


def profile(model_dir: str, rows: int, context: int, compiled: bool = False) -> None:
    from mlx_vlm import load

    sys.path.insert(0, os.path.dirname(__file__))
    from step_breakdown import build_engine_batch

    model, _ = load(model_dir)
    batch = build_engine_batch(model, rows, context, 40, ragged=True, use_decoder=True)
    if not compiled:
        batch.decoder.compiled = None
    profiled(lambda: batch.step().tokens, warm_up=4)


def profile_prefill(model_dir: str, rows: int, length: int) -> None:
    import mlx.core as mx
    from mlx_vlm import load

    from vlm_serve.engine.families import family_for
    from vlm_serve.engine.prefill import prefill_pass

    model, _ = load(model_dir)
    lm = model.language_model
    family = family_for(model)
    ids = mx.random.randint(10, 1000, (rows, length), key=mx.random.key(0))

    def one():
        return prefill_pass(model, family, ids, lm.model.embed_tokens(ids), lm.make_cache(), {})[0]

    profiled(one)


def profile_tower(model_dir: str, images: int) -> None:
    import mlx.core as mx
    from mlx_vlm import load

    from vlm_serve.engine import tower_gelu
    from vlm_serve.engine.families import family_for

    model, _ = load(model_dir)
    tower_gelu.install(model)  # as the engine's loader does (VLM_SERVE_TOWER_GELU picks the form)
    family = family_for(model)
    size = model.config.vision_config.image_size
    pixels = mx.random.uniform(shape=(images, 3, size, size))
    ids = mx.zeros((1, 1), mx.int32)

    def one():
        return family.encode_images(ids, pixels, {"pixel_values": pixels})

    profiled(one)


def summarize(path: str, top: int = 25) -> None:
    """Total time per kernel name from ncu's per-kernel summary (CSV), largest first."""
    rows = list(csv.reader(open(path)))
    header_at = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    header = rows[header_at]
    name, calls, metric, average = (header.index(c) for c in ("Kernel Name", "Invocations", "Metric Name", "Average"))
    total, launches = collections.Counter(), collections.Counter()
    for r in rows[header_at + 1:]:
        if len(r) == len(header) and "duration" in r[metric]:
            total[r[name][:90]] += float(r[average].replace(",", "")) * int(r[calls])
            launches[r[name][:90]] += int(r[calls])
    print(f"{sum(total.values()) / 1e6:.2f} ms of kernels in {sum(launches.values())} launches")
    for kernel, ns in total.most_common(top):
        print(f"{ns / 1e6:7.2f} ms {launches[kernel]:5d}x  {kernel}")


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)  # the engine's load log (padded sizes)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--context", type=int, default=320)
    p.add_argument("--prefill-length", type=int, help="profile prefill passes of this length")
    p.add_argument("--compiled", action="store_true",
                   help="the decode step compiled, as the server runs it up to 64 slots")
    p.add_argument("--tower-images", type=int, help="profile vision-tower calls of this many images")
    p.add_argument("--summarize", metavar="CSV")
    args = p.parse_args()
    if args.summarize:
        summarize(args.summarize)
    elif args.tower_images:
        profile_tower(args.model, args.tower_images)
    elif args.prefill_length:
        profile_prefill(args.model, args.batch, args.prefill_length)
    else:
        profile(args.model, args.batch, args.context, args.compiled)


if __name__ == "__main__":
    main()
