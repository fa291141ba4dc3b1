"""A burst of image requests, engine only (no HTTP): vlm-serve's engine against mlx-vlm's
``batch_generate`` (its BatchGenerator), same model, same images and prompts.

Every request is one image and ~64 words of text, greedy, a fixed output length. The
clock starts when the requests are handed over, preprocessing included for both. Run
each engine in its own process:

    python bench/burst.py --model DIR --engine vlm-serve --requests 64 --max-tokens 256
    python bench/burst.py --model DIR --engine mlx-vlm   --requests 64 --max-tokens 256

vlm-serve's engine is built as the server builds it (``vlm_serve.server.build_engine``:
the device's defaults, and on a GPU the warm-up; ``VLM_SERVE_*`` variables set its
flags, as the server's), and reports each request's time to first token; with
``--worker-parts``, also where its MLX worker's wall and CPU time went
(``turn_timeline``'s marks around the scheduler's parts: taking inputs, prefill steps,
shared starts, pixels to the device, tower calls, embeddings, shared passes, rows
joining, decode steps, their launch and read-back; they nest: a prefill step's time
holds its start's, a start's its tower calls'), up to the last first token and over the
whole burst; ``--timeline FILE`` keeps every mark in order. ``--rounds N`` serves the
burst N times on one engine and reports the last, with each round's wall time, TTFT and
traces of the compiled decode step (a round meets the shapes the ones before met).
``--preprocessed`` times the engine alone, every request's inputs ready before the clock
starts. ``batch_generate`` returns only when every request is done and times its prompt
and decode phases; its first tokens all come out of one batched prefill, so its TTFT is
estimated as the wall time before its decode phase (``wall - generation_time``), the
same for every request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

TEXT = " ".join(["describe the picture in detail"] * 12)

# The worker's parts timed by ``--worker-parts``: (class path, or "family" for the
# model's family class, method, label).
WORKER_PARTS = [
    ("vlm_serve.engine.scheduler.Scheduler", "_take_inputs", "take inputs"),
    ("vlm_serve.engine.scheduler.Scheduler", "_admit", "admit"),
    ("vlm_serve.engine.scheduler.Scheduler", "_prefill_step", "prefill step"),
    ("vlm_serve.engine.prefill_batch.PrefillGroup", "start", "shared start"),
    ("vlm_serve.engine.prefill.Prefill", "materialize", "materialize"),
    ("vlm_serve.engine.prefill.Prefill", "embed", "embed"),
    ("vlm_serve.engine.prefill_batch.PrefillGroup", "_pass", "shared pass"),
    ("vlm_serve.engine.prefill.Prefill", "start", "lone start"),
    ("family", "encode_images", "tower call"),
    ("vlm_serve.engine.scheduler.Scheduler", "_join", "join"),
    ("vlm_serve.engine.prefill.Prefill", "remember", "keep prefix"),
    ("vlm_serve.engine.batch.Batch", "add", "batch add"),
    ("vlm_serve.engine.scheduler.Scheduler", "_decode_step", "decode step"),
    ("vlm_serve.engine.scheduler.Scheduler", "_launch", "launch"),
    ("vlm_serve.engine.scheduler.Scheduler", "_process", "read back"),
]


def time_worker_parts(engine) -> None:
    """Mark the worker's parts (``turn_timeline.MARKS``) from now on."""
    import importlib

    sys.path.insert(0, str(Path(__file__).parent))
    import turn_timeline

    for owner, name, label in WORKER_PARTS:
        if owner == "family":
            target = type(engine.scheduler.family)
        else:
            module, cls = owner.rsplit(".", 1)
            target = getattr(importlib.import_module(module), cls)
        turn_timeline.timed(target, name, label)


def worker_parts(start: float, until: float) -> dict[str, list[float]]:
    """[wall, worker CPU] ms of each worker part that began at ``start`` or later and
    ended by ``until`` (``perf_counter`` times; the idle worker's wait for the first
    request began before): wall well over CPU is waiting, on the device or for the
    interpreter lock."""
    import turn_timeline

    marks = [mark for mark in turn_timeline.MARKS if mark[0] >= start]
    return {name: [round(wall, 1), round(cpu, 1)] for name, (wall, cpu) in turn_timeline.spans(marks, until).items()}


def timeline(start: float, ready, first) -> dict:
    """Every mark from ``start`` on ([s after start, label, worker CPU s]) and each
    request's preprocessing end and first token, for a look at the order of things."""
    import turn_timeline

    marks = [(round(t - start, 5), label, round(cpu, 5)) for t, label, cpu in turn_timeline.MARKS if t >= start]
    return {"marks": marks, "preprocessed_s": list(ready), "first_token_s": list(first)}


def images(n: int, size: int, seed: int) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)) for _ in range(n)]


def run_vlm_serve(args) -> dict:
    from vlm_serve.cli import parse_config
    from vlm_serve.engine.types import SamplingParams
    from vlm_serve.preprocess.media import MediaPolicy
    from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat
    from vlm_serve.server import build_engine

    # The engine as the server builds and starts it, from the same flags and VLM_SERVE_*
    # variables: its defaults for this device (prefill passes and budget, prompts
    # gathered for shared passes, last passes padded to coarse lengths, the shortest
    # prefix reused) and its warm-up (on a GPU, every batch shape's kernels built before
    # the first request, as the server does before it reports ready).
    argv = ["--model", args.model, "--max-num-seqs", str(args.requests)]
    if args.prefill_token_budget:
        argv += ["--prefill-token-budget", str(args.prefill_token_budget)]
    argv += args.serve_args.split()
    config = parse_config(argv)
    engine = build_engine(config)
    loaded = engine.loaded
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 4, loaded.chat_template)
    prompt = render_chat(ctx, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)

    # Preprocessing runs off the event loop on a pool the size of the server's.
    pool = ThreadPoolExecutor(args.cpu_workers or config.cpu_workers)

    def prepare(i: int, image: Image.Image):
        return prepare_prompt(ctx, f"r{i}", prompt, params, [image])

    async def burst(batch: list, preprocessed: bool = False) -> list[tuple[float, float, int]]:
        """``batch``: images, or with ``preprocessed`` each request's prepared inputs."""
        loop = asyncio.get_running_loop()
        start = time.perf_counter()

        async def one(i: int, item) -> tuple[float, float, int]:
            prepared = item if preprocessed else await loop.run_in_executor(pool, prepare, i, item)
            ready_at, first, n = time.perf_counter() - start, None, 0
            async for event in engine.submit(prepared):
                if first is None and event.token_ids:
                    first = time.perf_counter() - start
                n += len(event.token_ids)
            return ready_at, first, n

        return await asyncio.gather(*(one(i, im) for i, im in enumerate(batch)))

    asyncio.run(burst(images(4, args.image_size, 1)))  # warm-up
    if args.worker_parts:
        time_worker_parts(engine)
    def batch_of_round(n: int) -> list:
        # Each round its own images (the prefix and vision caches would hold a repeat's),
        # unless --same-images.
        batch = images(args.requests, args.image_size, 0 if args.same_images else 1000 * n)
        if args.preprocessed:  # the engine alone: every request's inputs ready before the clock starts
            batch = [prepare(i, image) for i, image in enumerate(batch)]
        return batch

    decoder = engine.scheduler.batch.decoder

    def traces() -> int:
        return getattr(decoder, "traces", 0)

    rounds = []
    for n in range(args.rounds):  # the last round is the result; earlier ones met its shapes first
        batch = batch_of_round(n)
        towers, traced = engine.scheduler.shared_tower_requests, traces()
        t, started_unix = time.perf_counter(), time.time()
        ready, ttfts, tokens = zip(*asyncio.run(burst(batch, args.preprocessed)))
        wall = time.perf_counter() - t
        rounds.append({"wall_s": round(wall, 3), "ttft_mean_s": round(float(np.mean(ttfts)), 3),
                       "ttft_max_s": round(float(np.max(ttfts)), 3), "step_traces": traces() - traced})
    engine.shutdown()
    result = {"started_unix": started_unix,  # to place files written meanwhile (MLX's kernel cache)
              "tokens": sum(tokens), "wall_s": wall, "ttft_mean_s": float(np.mean(ttfts)),
              "ttft_p50_s": float(np.median(ttfts)), "ttft_max_s": float(np.max(ttfts)),
              # when each request's preprocessing (image processor, template, tokens) was done
              "preprocessed_mean_s": float(np.mean(ready)), "preprocessed_max_s": float(np.max(ready)),
              "shared_tower_requests": engine.scheduler.shared_tower_requests - towers,
              # the compiled decode step's traces of new shapes (its slots and KV columns)
              "step_traces": rounds[-1]["step_traces"],
              # their (slots, each kind's KV columns)
              "step_trace_shapes": getattr(decoder, "traced_shapes", [])[traced:]}
    if args.rounds > 1:
        result["rounds"] = rounds
    if args.worker_parts:
        result["worker_ms_to_last_first_token"] = worker_parts(t, t + max(ttfts))
        result["worker_ms"] = worker_parts(t, t + wall)
    if args.timeline:
        with open(args.timeline, "w") as f:
            json.dump(timeline(t, ready, ttfts), f)
    return result


def run_mlx_vlm(args) -> dict:
    import mlx_vlm.utils
    from mlx_vlm import batch_generate, load

    model, processor = load(args.model)
    # transformers 5 reads a flat list of images as one prompt's images and refuses a
    # batch of prompts with one image each; hand it one list per prompt.
    process = mlx_vlm.utils.process_inputs_with_fallback

    def one_image_list_per_prompt(processor, prompts, images, audio, **kwargs):
        if isinstance(images, list) and isinstance(prompts, list) and len(images) == len(prompts):
            images = [[image] for image in images]
        return process(processor, prompts, images, audio, **kwargs)

    mlx_vlm.utils.process_inputs_with_fallback = one_image_list_per_prompt

    def burst(batch: list[Image.Image]):
        return batch_generate(model, processor, images=batch, prompts=[TEXT] * len(batch),
                              max_tokens=args.max_tokens)  # greedy by default

    burst(images(4, args.image_size, 1))  # warm-up
    batch = images(args.requests, args.image_size, 0)
    t = time.perf_counter()
    response = burst(batch)
    wall = time.perf_counter() - t
    stats = response.stats
    ttft = wall - stats.generation_time
    return {"tokens": stats.generation_tokens, "wall_s": wall, "ttft_mean_s": ttft,
            "prompt_time_s": stats.prompt_time, "generation_time_s": stats.generation_time}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--engine", choices=("vlm-serve", "mlx-vlm"), required=True)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--image-size", type=int, default=896)
    p.add_argument("--cpu-workers", type=int, help="vlm-serve's preprocessing threads (default: the server's)")
    p.add_argument("--prefill-token-budget", type=int,
                   help="vlm-serve: prompt tokens prefilled per turn (default: the server's)")
    p.add_argument("--serve-args", default="",
                   help="further vlm-serve flags for the engine, e.g. a GPU's scheduling on the CPU: "
                        "'--prefill-step-size 2048 --prefill-token-budget 2048 --prefill-wait-steps 8'")
    p.add_argument("--rounds", type=int, default=1,
                   help="vlm-serve: run the burst this many times on one engine and report the last "
                   "(with each round's wall, TTFT and step traces): shapes met first are then met again")
    p.add_argument("--same-images", action="store_true",
                   help="vlm-serve with --rounds: every round the same images (with the prefix cache "
                   "off, VLM_SERVE_PREFIX_CACHE_SIZE=0, a round after the first then finds every "
                   "image's features in the vision cache and runs no tower call)")
    p.add_argument("--preprocessed", action="store_true",
                   help="vlm-serve: preprocess every request before the clock starts (the engine alone)")
    p.add_argument("--worker-parts", action="store_true",
                   help="vlm-serve: time the worker's parts (a little overhead on each)")
    p.add_argument("--timeline", help="vlm-serve with --worker-parts: write every mark and each "
                   "request's preprocessing end and first token here (JSON)")
    p.add_argument("--result-json")
    args = p.parse_args()
    result = run_vlm_serve(args) if args.engine == "vlm-serve" else run_mlx_vlm(args)
    result = {"engine": args.engine, "requests": args.requests, "max_tokens": args.max_tokens,
              **result, "output_tok_s": result["tokens"] / result["wall_s"]}
    print(json.dumps(result, indent=2))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
