"""Turn 2 of an image chat whose turn 1 answered at length: the engine's time to first
token for turn 2, which resends turn 1's prompt, its answer and a new question.

A chat client sends the answer back as text; a real model's answer comes back as the
same tokens, but a random-weight fixture's answers are byte soup that retokenizes
differently. So turn 2 is built here as a client's would tokenize for a real model:
turn 1's prompt ids, the answer's generated ids, then the template's tokens for the
new question. The engine runs in this process, as the server builds it
(``server.build_engine``: on a GPU, warmed up and with padded passes).

    python bench/answer_reuse.py --model DIR [--answer-tokens 32,128,512] [--conversations 4]

Per answer length: turn 1 and turn 2 TTFT (median ms, from submit to the first
token), and turn 2's prompt tokens and how many of them the prefix cache held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from serve import make_image_array  # noqa: E402

from vlm_serve.config import ServerConfig  # noqa: E402
from vlm_serve.engine.types import SamplingParams  # noqa: E402
from vlm_serve.preprocess.media import MediaPolicy  # noqa: E402
from vlm_serve.preprocess.prompt import PromptContext, prepare_prompt, render_chat  # noqa: E402
from vlm_serve.server import build_engine  # noqa: E402

QUESTION = {"role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "Describe this picture in detail."}]}
FOLLOW_UP = {"role": "user", "content": "Tell me more about it."}


async def generate(engine, prepared) -> tuple[float, list[int], int]:
    """TTFT in seconds, the generated ids and the prompt tokens the prefix cache held."""
    start, first, tokens, cached = time.perf_counter(), None, [], 0
    async for event in engine.submit(prepared):
        if event.token_ids and first is None:
            first = time.perf_counter()
        tokens += event.token_ids
        if event.error:
            raise RuntimeError(event.error)
        if event.stats:
            cached = event.stats.get("cached_tokens") or 0
    return first - start, tokens, cached


def turn_two(ctx, first, answer: list[int], image):
    """Turn 1's prompt ids, the answer's ids, then the template's ids for the follow-up."""
    tokenizer = getattr(ctx.processor, "tokenizer", ctx.processor)
    opening = render_chat(ctx, [QUESTION])
    marker = "ANSWER"
    whole = render_chat(ctx, [QUESTION, {"role": "assistant", "content": marker}, FOLLOW_UP])
    assert whole.startswith(opening), "the template renders turn 1 differently in turn 2"
    tail = whole[whole.index(marker, len(opening)) + len(marker):]
    prepared = prepare_prompt(ctx, first.request_id + "-2", whole,
                              SamplingParams(max_tokens=1, temperature=0.0), [image])
    ids = first.input_ids.tolist() + answer + tokenizer.encode(tail, add_special_tokens=False)
    prepared.input_ids = np.array(ids, np.int32)
    if "attention_mask" in prepared.model_inputs:
        prepared.model_inputs["attention_mask"] = np.ones((1, len(ids)), np.int32)
    return prepared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--answer-tokens", default="32,128,512")
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=896)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    engine = build_engine(ServerConfig(model=args.model, log_level="warning"))
    loaded = engine.loaded
    ctx = PromptContext(loaded.processor, loaded.model_type, MediaPolicy(), 1, loaded.chat_template)
    tokenizer = getattr(loaded.processor, "tokenizer", loaded.processor)
    special = tokenizer.all_special_ids
    results = {}
    for n in map(int, args.answer_tokens.split(",")):
        rows = []
        for c in range(args.conversations + 1):  # the first conversation warms up
            image = Image.fromarray(make_image_array(np.random.default_rng(1000 * n + c),
                                                     args.image_size, args.image_size, "noise"))
            prompt = render_chat(ctx, [QUESTION])
            # No special tokens in the answer, as in a real model's (a random model's may
            # hold an image placeholder, one too many for turn 2's images).
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True,
                                    logit_bias={t: -1e9 for t in special})
            first = prepare_prompt(ctx, f"c{n}-{c}", prompt, params, [image])
            ttft1, answer, _ = asyncio.run(generate(engine, first))
            second = turn_two(ctx, first, answer, image)
            ttft2, _, cached = asyncio.run(generate(engine, second))
            if c:
                rows.append((ttft1, ttft2, second.num_prompt_tokens, cached))
        results[n] = {
            "turn1_ttft_ms": round(1000 * statistics.median(r[0] for r in rows), 1),
            "turn2_ttft_ms": round(1000 * statistics.median(r[1] for r in rows), 1),
            "turn2_prompt_tokens": statistics.median(r[2] for r in rows),
            "turn2_cached_tokens": statistics.median(r[3] for r in rows),
        }
        print(f"answer {n:4d} tokens: " + ", ".join(f"{k} {v}" for k, v in results[n].items()), flush=True)
    engine.shutdown()
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump({"config": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
