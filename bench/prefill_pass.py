"""One prefill pass of a prompt, through mlx-vlm's model code and through the family's
engine decoder (fused weights, output layer on the last position only), on fresh
caches: milliseconds per pass, passes queued back to back as the scheduler queues
them, and whether the two give the same logits bit for bit.

    python bench/prefill_pass.py --model DIR [--lengths 64,270,2048] [--rows 1] [--reps 20]

``--rows B`` stacks B prompts of each length in one pass, as a burst's shared passes do.
``--phases`` also splits one engine pass (median of the reps), each started on an idle
device: building its graph, ``mx.async_eval``'s wall and CPU time, and the wait for the
device after it. An ``async_eval`` whose CPU time is near its wall time is MLX launching
kernels on the host; one whose wall time far exceeds its CPU time waits for the device.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx_vlm import load

from vlm_serve.engine.families import family_for
from vlm_serve.engine.prefill import prefill_pass


class _ModelCode:
    """A family whose prefill passes run through the model code."""

    def prefill_decoder(self, kwargs):
        return None


def phases(one, reps: int) -> dict:
    """Median milliseconds of one pass's phases, each pass started on an idle device."""
    marks = []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        out = one()
        built = time.perf_counter()
        cpu = time.thread_time()
        mx.async_eval(out)
        launched, cpu = time.perf_counter(), time.thread_time() - cpu
        mx.eval(out)
        marks.append((built - start, launched - built, cpu, time.perf_counter() - launched))
    names = ("build ms", "async_eval ms", "async_eval cpu ms", "device after ms")
    return {name: round(1000 * statistics.median(m[i] for m in marks), 2) for i, name in enumerate(names)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--lengths", default="64,270,2048")
    parser.add_argument("--rows", type=int, default=1, help="prompts per pass")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--phases", action="store_true", help="split one engine pass's host time")
    parser.add_argument("--out")
    args = parser.parse_args()
    model, _ = load(args.model)
    lm = model.language_model
    family = family_for(model)
    if family.prefill_decoder({}) is None:
        raise SystemExit(f"{family.name}: no engine prefill pass")
    paths = {"model code": _ModelCode(), "engine": family}
    vocab = lm.model.embed_tokens.weight.shape[0]  # ids past it would read outside the table
    results = []
    for length in map(int, args.lengths.split(",")):
        ids = mx.random.randint(10, min(1000, vocab), (args.rows, length), key=mx.random.key(length))
        row = {"rows": args.rows, "tokens": length}
        logits = {}
        for name, path in paths.items():
            def one():
                # Embedded anew each time: the model code scales its input in place.
                embeds = lm.model.embed_tokens(ids)
                return prefill_pass(model, path, ids, embeds, lm.make_cache(), {})[0]
            logits[name] = one()
            mx.eval(logits[name], one())
            start = time.perf_counter()
            outs = []
            for _ in range(args.reps):
                outs.append(one())
                mx.async_eval(outs[-1])
            mx.eval(outs)
            ms = 1000 * (time.perf_counter() - start) / args.reps
            row[f"{name} ms"] = round(ms, 2)
            row[f"{name} tok/s"] = round(args.rows * length / ms * 1000)
        row["bit-equal"] = bool(mx.array_equal(logits["model code"], logits["engine"]).item())
        if args.phases:
            row.update(phases(lambda: prefill_pass(model, family, ids, lm.model.embed_tokens(ids),
                                                   lm.make_cache(), {})[0], args.reps))
        print(json.dumps(row), flush=True)
        results.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model, "mlx": mx.__version__, "device": str(mx.default_device()),
                       "passes": results}, f, indent=1)


if __name__ == "__main__":
    main()
