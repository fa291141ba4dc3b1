"""How many language-model prefill passes a closed loop of chats costs, engine only.

CONCURRENCY clients each send chats one after another, REQUESTS in all, each decoded to
--max-tokens: the prompts of ``bench/serve.py`` (a unique marker, then common words),
with --image-size an image after the text. Every prefill pass is counted with its rows
and tokens. On a GPU a pass costs the host about as much for one prompt as for seven,
so passes per request is what a loaded server's prefill costs there; this counts them
on any device.

``--scheduler gpu`` uses the scheduler settings a GPU server runs with (2,048-token
passes and budget, prompts waiting up to 8 steps to share a pass, bucketed last passes)
wherever this runs. ``--window N`` serves a copy of the model whose sliding window is N
tokens (the tiny fixtures' window of 32 keeps ~270-token prompts from sharing padded
passes; Gemma 3's is 1,024). ``--reprefill-tokens`` sets
``prefill_batch.REPREFILL_TOKENS`` (0: prompts share passes only from cached prefixes
of one length). The result also gives where the decode turns went (the engine's
``DecodeTimes`` over the whole run): beside a server's under the same load, the
difference is what serving HTTP costs the worker.

    python bench/prefill_passes.py --model DIR --scheduler gpu --window 1024
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import make_prompt_text  # noqa: E402 - the same prompts as the HTTP benchmark


def with_window(model: str, window: int) -> str:
    """A directory that serves ``model`` with its sliding window set to ``window``."""
    out = Path(tempfile.mkdtemp(prefix="prefill-passes-"))
    for item in Path(model).iterdir():
        if item.name != "config.json":
            os.symlink(item.resolve(), out / item.name)
    config = json.loads((Path(model) / "config.json").read_text())
    text = config.get("text_config", config)
    if "sliding_window" not in text:
        raise SystemExit(f"{model}: no sliding_window in its config")
    text["sliding_window"] = window
    (out / "config.json").write_text(json.dumps(config))
    return str(out)


def count_passes(passes: list[tuple[int, int]]) -> None:
    """Record (rows, tokens) of every prefill pass, wherever it runs from."""
    from vlm_serve.engine import prefill, prefill_batch

    original = prefill.prefill_pass

    def counted(model, family, ids, *args, **kwargs):
        passes.append(tuple(ids.shape[:2]))
        return original(model, family, ids, *args, **kwargs)

    prefill.prefill_pass = prefill_batch.prefill_pass = counted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt-tokens", type=int, default=256, help="approximate, as bench/serve.py")
    p.add_argument("--image-size", type=int, default=0,
                   help="N: each chat also has an NxN image after its text (as bench/serve.py's)")
    p.add_argument("--scheduler", choices=["auto", "gpu"], default="auto",
                   help="auto: the server's defaults on this device")
    p.add_argument("--window", type=int, help="serve a copy with this sliding window")
    p.add_argument("--reprefill-tokens", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json")
    args = p.parse_args()

    from vlm_serve.engine import prefill_batch
    from vlm_serve.engine.engine import Engine
    from vlm_serve.engine.scheduler import SchedulerConfig
    from vlm_serve.engine.types import SamplingParams
    from vlm_serve.preprocess.media import MediaPolicy
    from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat
    from vlm_serve.server import default_prefill_budget, default_prefill_wait, on_gpu

    if args.reprefill_tokens is not None:
        prefill_batch.REPREFILL_TOKENS = args.reprefill_tokens
    gpu = args.scheduler == "gpu" or on_gpu()
    budget = 2048 if gpu else default_prefill_budget()
    # No periodic stats line: its reset would leave the decode turns' parts of the last
    # window only; the result reports them for the whole run.
    config = SchedulerConfig(max_num_seqs=args.concurrency, prefill_step_size=budget, prefill_token_budget=budget,
                             prefill_wait_steps=8 if gpu else default_prefill_wait(), bucket_last_passes=gpu,
                             stats_interval_s=float("inf"))
    model = with_window(args.model, args.window) if args.window else args.model
    engine = Engine(model, config)
    engine.start()
    loaded = engine.loaded
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 4, loaded.chat_template)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed)

    def request(i: int):
        text, _ = make_prompt_text(rng, args.prompt_tokens)
        if not args.image_size:
            return prepare_prompt(ctx, f"r{i}", render_chat(ctx, [{"role": "user", "content": text}]), params, [])
        pixels = np.random.default_rng([args.seed, i]).integers(0, 256, (args.image_size, args.image_size, 3))
        content = [{"type": "text", "text": text}, {"type": "image"}]
        return prepare_prompt(ctx, f"r{i}", render_chat(ctx, [{"role": "user", "content": content}]), params,
                              [Image.fromarray(pixels.astype(np.uint8))])

    passes: list[tuple[int, int]] = []
    count_passes(passes)
    ttfts: list[float] = []
    prompt_tokens: list[int] = []

    async def loop():
        queue = iter(range(args.requests))

        async def client():
            for i in queue:
                prepared = request(i)
                prompt_tokens.append(prepared.num_prompt_tokens)
                sent, first = time.perf_counter(), True
                async for event in engine.submit(prepared):
                    if first and event.token_ids:
                        ttfts.append(time.perf_counter() - sent)
                        first = False

        await asyncio.gather(*(client() for _ in range(args.concurrency)))

    start = time.perf_counter()
    asyncio.run(loop())
    wall = time.perf_counter() - start
    stats = engine.scheduler.prefix_cache
    decode_turns = engine.scheduler.decode_times.describe()
    engine.shutdown()
    rows = sum(r for r, _ in passes)
    result = {
        "requests": args.requests, "concurrency": args.concurrency, "scheduler": "gpu" if gpu else "cpu",
        "window": args.window, "reprefill_tokens": prefill_batch.REPREFILL_TOKENS,
        "prompt_tokens_mean": round(sum(prompt_tokens) / len(prompt_tokens), 1),
        "passes": len(passes), "passes_per_request": round(len(passes) / args.requests, 2),
        "rows_per_pass": round(rows / len(passes), 2),
        "pass_tokens_mean": round(sum(r * t for r, t in passes) / len(passes), 1),
        "reused_tokens_per_request": round(stats.reused_tokens / args.requests, 1) if stats else None,
        "wall_s": round(wall, 2), "output_tok_s": round(args.requests * args.max_tokens / wall, 1),
        "ttft_mean_ms": round(1000 * sum(ttfts) / len(ttfts), 1),
        "decode_turns": decode_turns,
    }
    print(json.dumps(result, indent=2))
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
