"""Where the first wave of a text burst spends its time, engine only (no HTTP).

N text requests of ~P prompt words each (every prompt a little different in length, as
real ones are) arrive at once; the engine prefills them within its token budget between
decode steps and decodes each to --max-tokens. This times each stage of the worker's
turns: embedding and prefix lookup, prefill passes (chunks and last tokens), rows joining
(sampling the first token), the prefix cache's copy, the store's join, decode steps; and
reports the time to first token and the steady decode rate (every row's tokens between
the last first token and the first finish). ``--sync`` waits for the device after every
stage, so each stage carries its own device time (slower overall, but attributable);
without it a stage's device work shows up wherever the worker next waits.

    python bench/prefill_wave.py --model DIR --requests 64 --prompt-words 256 [--sync]

``--time-evals`` also times every ``mx.async_eval`` of the measured wave by its call
site (file:line): how long the worker spends handing each kind of graph to MLX, which
on a GPU includes any wait MLX makes before it returns.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np

WORDS = ("time person year way day thing man world life hand part child eye woman place "
         "work week case point number group problem fact").split()

# (class path, method, stage name); the name may depend on the call (see ``stage_of``).
TIMED = [
    ("vlm_serve.engine.prefill.Prefill", "step", None),
    ("vlm_serve.engine.prefill_batch.PrefillGroup", "step", "shared prefill"),
    ("vlm_serve.engine.scheduler.Scheduler", "_join", "join: first token"),
    ("vlm_serve.engine.prefix_cache.PrefixCache", "store", "prefix cache: store"),
    ("vlm_serve.engine.prefix_cache.PrefixCache", "lookup", "prefix cache: lookup"),
    ("vlm_serve.engine.batch.Batch", "add", "batch: add rows"),
    ("vlm_serve.engine.scheduler.Scheduler", "_decode_step", "decode step"),
]


def stage_of(name, obj) -> str:
    """A single prompt's step is one of: start (embed, lookup), a chunk, the last token."""
    if name:
        return name
    if obj.embeds is None and not obj.done:
        return "prefill: start"
    n, last = obj.next_chunk()
    return "prefill: last pass" if last else "prefill: chunk"


def instrument(totals: dict, counts: dict, sync: bool) -> None:
    import importlib

    depth = [0]
    for path, method, name in TIMED:
        module, cls = path.rsplit(".", 1)
        klass = getattr(importlib.import_module(module), cls)
        original = getattr(klass, method)

        def timed(self, *a, _original=original, _name=name, **k):
            if depth[0]:  # time only the outermost stage
                return _original(self, *a, **k)
            stage = stage_of(_name, self)
            depth[0] += 1
            t = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                if sync:
                    mx.synchronize()
                totals[stage] += time.perf_counter() - t
                counts[stage] += 1
                depth[0] -= 1

        setattr(klass, method, timed)


def time_evals(times: dict) -> None:
    """Wrap ``mx.async_eval`` so each call's wall and CPU time are added to
    ``times[call site]``: CPU time near the wall is MLX launching kernels on the host,
    wall time far past it is MLX waiting for the device before it returns."""
    real = mx.async_eval

    def timed(*a, **k):
        caller = sys._getframe(1)
        t, cpu = time.perf_counter(), time.thread_time()
        try:
            return real(*a, **k)
        finally:
            site = f"{caller.f_code.co_filename.rsplit('/', 1)[-1]}:{caller.f_lineno}"
            times[site].append((time.perf_counter() - t, time.thread_time() - cpu))

    mx.async_eval = timed


def eval_summary(times: dict) -> dict:
    out = {}
    for site, calls in sorted(times.items(), key=lambda kv: -sum(w for w, _ in kv[1])):
        ts = sorted(w for w, _ in calls)
        out[site] = {"calls": len(ts), "total_ms": round(1000 * sum(ts), 1),
                     "cpu_ms": round(1000 * sum(c for _, c in calls), 1),
                     "p50_ms": round(1000 * ts[len(ts) // 2], 2),
                     "largest_ms": [round(1000 * t, 1) for t in ts[-8:]]}
    return out


def prompts(n: int, words: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(words * rng.uniform(0.8, 1.2))
        out.append(f"Request {i:04d}: " + " ".join(rng.choice(WORDS, size=length)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-words", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prefill-step-size", type=int, default=512)
    p.add_argument("--sync", action="store_true", help="wait for the device after each stage")
    p.add_argument("--time-evals", action="store_true", help="time each mx.async_eval by call site")
    p.add_argument("--result-json")
    args = p.parse_args()

    from vlm_serve.engine.engine import Engine
    from vlm_serve.engine.scheduler import SchedulerConfig
    from vlm_serve.engine.types import SamplingParams
    from vlm_serve.preprocess.media import MediaPolicy
    from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat

    totals: dict = defaultdict(float)
    counts: dict = defaultdict(int)
    engine = Engine(args.model, SchedulerConfig(max_num_seqs=args.requests,
                                                prefill_step_size=args.prefill_step_size))
    engine.start()
    loaded = engine.loaded
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 4, loaded.chat_template)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    def prepared(texts, tag):
        return [prepare_prompt(ctx, f"{tag}{i}", render_chat(ctx, [{"role": "user", "content": t}]),
                               params, []) for i, t in enumerate(texts)]

    async def wave(batch):
        start = time.perf_counter()

        async def one(request):
            times = []  # when each token arrived
            async for event in engine.submit(request):
                times += [time.perf_counter() - start] * len(event.token_ids)
            return times

        return await asyncio.gather(*(one(r) for r in batch)), time.perf_counter() - start

    asyncio.run(wave(prepared(prompts(8, args.prompt_words, 1), "w")))  # warm-up
    instrument(totals, counts, args.sync)
    evals: dict = defaultdict(list)
    if args.time_evals:
        time_evals(evals)
    batch = prepared(prompts(args.requests, args.prompt_words, 0), "r")
    results, wall = asyncio.run(wave(batch))
    engine.shutdown()
    ttfts = [r[0] for r in results]
    # Steady decode: every row's tokens between the last first token and the first finish.
    begin, end = max(ttfts), min(r[-1] for r in results)
    steady = sum(begin < t <= end for r in results for t in r) / (end - begin) if end > begin else None
    lengths = [len(r.input_ids) for r in batch]
    result = {
        "requests": args.requests, "prompt_tokens_mean": float(np.mean(lengths)),
        "distinct_lengths": len(set(lengths)), "sync": args.sync,
        "prefill_step_size": args.prefill_step_size,
        "wall_s": round(wall, 3), "ttft_mean_s": round(float(np.mean(ttfts)), 3),
        "ttft_max_s": round(float(np.max(ttfts)), 3),
        "steady_tok_s": round(steady, 1) if steady else None,
        "stages_ms": {k: round(1000 * v, 1) for k, v in sorted(totals.items(), key=lambda kv: -kv[1])},
        "calls": dict(counts),
        "ms_per_call": {k: round(1000 * totals[k] / counts[k], 2) for k in counts},
    }
    if args.time_evals:
        result["async_eval_by_site"] = eval_summary(evals)
    print(json.dumps(result, indent=2))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
