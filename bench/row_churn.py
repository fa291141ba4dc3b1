"""What rows joining and leaving cost a running batch: the engine's own decode steps,
queued one ahead as the scheduler queues them, with no churn and with one row leaving
and another joining every ``--every`` steps (as in a closed loop at high concurrency,
where a request ends and the next one starts every couple of steps).

    python bench/row_churn.py --model DIR [--batch 128] [--context 320] [--steps 64] [--every 2,8]

Prints the mean step time of each series; the difference per swap is what a leaving
and a joining row cost the batch (store copies, on the device).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
from mlx_vlm import load
from step_breakdown import build_engine_batch  # noqa: E402 - run from bench/ or with it on the path

from vlm_serve.engine.batch import JoiningRow
from vlm_serve.engine.sampling import BatchSampler
from vlm_serve.engine.types import SamplingParams


def series(model, batch_size: int, context: int, steps: int, every: int, joiners: list) -> float:
    batch = build_engine_batch(model, batch_size, context, steps + 16, ragged=True, use_decoder=True)
    mx.eval(batch.next_tokens, batch.store.keys, batch.store.values)
    inflight, swaps = None, 0
    start = time.perf_counter()
    for s in range(steps):
        if every and s and s % every == 0:
            batch.keep(list(range(1, len(batch))))  # the oldest row leaves...
            batch.add([joiners[swaps % len(joiners)]])  # ...and a prefilled one joins
            swaps += 1
        out = batch.step()
        mx.async_eval(out.tokens)
        if inflight is not None:
            inflight.tokens.tolist()
        inflight = out
    inflight.tokens.tolist()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--every", default="2,8", help="steps between swaps, comma-separated")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model, _ = load(args.model)
    joiners = _joiners(model, args.context)
    for _ in range(args.repeats):
        for every in [0, *(int(e) for e in args.every.split(","))]:
            ms = 1000 * series(model, args.batch, args.context, args.steps, every, joiners)
            label = "no churn" if not every else f"a swap every {every} steps"
            print(f"B={args.batch} context {args.context}: {label:24s} {ms:7.2f} ms/step", flush=True)


def _joiners(model, context: int) -> list[JoiningRow]:
    """Rows that finished prefill, as the scheduler hands them to the batch: built
    once and joined again and again (the batch copies their caches in)."""
    source = build_engine_batch(model, 4, context, 8, ragged=True, use_decoder=True)
    rows = []
    for i in range(len(source)):
        sampler = BatchSampler(source.vocab_size)
        sampler.add(SamplingParams(max_tokens=1 << 20, temperature=0.0), [])
        rows.append(JoiningRow(source.row_cache(i), sampler, mx.array([1], mx.int32), source.row_states[i]))
    return rows


if __name__ == "__main__":
    main()
