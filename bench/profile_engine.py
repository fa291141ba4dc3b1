"""Where the time of a decode-heavy load goes, engine only (no HTTP).

Submits N requests at once (one image + ~64 text tokens, fixed output length), then
reports the engine's output tokens/s and the worker thread's time split: prefill,
queueing decode steps (graph building), reading results back (waiting on the device
plus detokenizing and stop checks), and the top functions under cProfile.

    python bench/profile_engine.py --model DIR --concurrency 64 --max-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import time
from collections import defaultdict

import numpy as np
from PIL import Image

from vlm_serve.engine.engine import Engine
from vlm_serve.engine.scheduler import Scheduler, SchedulerConfig
from vlm_serve.engine.types import SamplingParams
from vlm_serve.preprocess.media import MediaPolicy
from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat

TIMED = ("_prefill_step", "_launch", "_process", "_flush", "_drain_inbox")


def instrument(totals: dict) -> None:
    for name in TIMED:
        original = getattr(Scheduler, name)

        def timed(self, *a, _original=original, _name=name, **k):
            t = time.perf_counter()
            try:
                return _original(self, *a, **k)
            finally:
                totals[_name] += time.perf_counter() - t
                totals[_name + "_calls"] += 1

        setattr(Scheduler, name, timed)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--image-size", type=int, default=896)
    p.add_argument("--profile", action="store_true", help="also run cProfile on the worker")
    p.add_argument("--result-json")
    args = p.parse_args()

    totals: dict = defaultdict(float)
    instrument(totals)
    profiler = cProfile.Profile()
    if args.profile:
        original_run = Scheduler.run

        def profiled_run(self):
            profiler.enable()
            try:
                original_run(self)
            finally:
                profiler.disable()

        Scheduler.run = profiled_run
    engine = Engine(args.model, SchedulerConfig(max_num_seqs=args.concurrency))
    engine.start()
    loaded = engine.loaded
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 4, loaded.chat_template)
    rng = np.random.default_rng(0)
    prompt = render_chat(ctx, [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": " ".join(["describe the picture in detail"] * 12)}]}])

    def request(i: int):
        image = Image.fromarray(rng.integers(0, 255, (args.image_size, args.image_size, 3), dtype=np.uint8))
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        return prepare_prompt(ctx, f"r{i}", prompt, params, [image])

    async def run_all(prepared):
        async def one(p):
            n = 0
            async for event in engine.submit(p):
                n += len(event.token_ids)
            return n

        return await asyncio.gather(*(one(p) for p in prepared))

    asyncio.run(run_all([request(i) for i in range(4)]))  # warm up
    for key in list(totals):
        totals[key] = 0.0
    prepared = [request(i) for i in range(args.concurrency)]
    t = time.perf_counter()
    tokens = sum(asyncio.run(run_all(prepared)))
    wall = time.perf_counter() - t
    engine.shutdown()
    result = {
        "concurrency": args.concurrency,
        "tokens": tokens,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        "worker_time_s": {k: round(v, 3) for k, v in totals.items() if not k.endswith("_calls")},
        "calls": {k[:-6]: int(v) for k, v in totals.items() if k.endswith("_calls")},
    }
    if args.profile:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        result["profile_top"] = out.getvalue()
    print(json.dumps({k: v for k, v in result.items() if k != "profile_top"}, indent=2))
    if args.profile:
        print(result["profile_top"])
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
