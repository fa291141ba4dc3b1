"""Multi-turn image chat: time to first token of turns 1..T, as chat clients send them
(the whole conversation every turn, the image in turn 1).

Run it against a server with the prefix cache on and one with it off
(``--prefix-cache-size 0``) to see what reuse saves:

    python bench/multiturn.py --base-url http://127.0.0.1:8000/v1 --turns 5 \
        --conversations 4 --image-size 448 --result-json warm.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from serve import encode_data_url, make_image_array  # noqa: E402


def image_url(size: int, seed: int, fmt: str = "png", content: str = "noise") -> str:
    """A data URL of a square image (noise as PNG: the largest body a chat client sends
    for its size; a gradient as JPEG: about a photo's)."""
    pixels = make_image_array(np.random.default_rng(seed), size, size, content)
    return encode_data_url(pixels, fmt)


def ttft(client: httpx.Client, base_url: str, messages: list, max_tokens: int,
         clock: list | None = None) -> tuple[float, str, int]:
    """Seconds to the first content token, the answer, and the cached prompt tokens;
    ``clock`` gets ``time.perf_counter()`` at the request's start and first token."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    # Serialized before the clock starts, as bench/serve.py does: a client's own JSON
    # encoding of a multi-megabyte image is not the server's time to first token.
    content = json.dumps(body).encode()
    start, first, text, cached = time.perf_counter(), None, "", 0
    with client.stream("POST", base_url + "/chat/completions", content=content,
                       headers={"Content-Type": "application/json"}) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens") or 0
            for choice in chunk.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    first = first or time.perf_counter()
                    text += piece
    first = first or time.perf_counter()
    if clock is not None:
        clock += [start, first]
    return first - start, text, cached


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=448)
    parser.add_argument("--image-format", choices=("png", "jpeg"), default="png")
    parser.add_argument("--image-content", choices=("noise", "gradient"), default="noise")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    per_turn: dict[int, list[float]] = {t: [] for t in range(1, args.turns + 1)}
    cached: dict[int, list[int]] = {t: [] for t in range(1, args.turns + 1)}
    with httpx.Client(timeout=600) as client:
        for c in range(args.conversations):
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image_url(args.image_size, c, args.image_format, args.image_content)}},
                {"type": "text", "text": "Describe this picture in detail."}]}]
            for turn in range(1, args.turns + 1):
                seconds, answer, hit = ttft(client, args.base_url, messages, args.max_tokens)
                per_turn[turn].append(seconds)
                cached[turn].append(hit)
                messages += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": f"Tell me more, part {turn + 1}."}]
    result = {
        "config": vars(args),
        "ttft_ms_median": {t: round(1000 * statistics.median(v), 1) for t, v in per_turn.items()},
        "cached_tokens_median": {t: statistics.median(v) for t, v in cached.items()},
    }
    print(json.dumps(result, indent=1))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
