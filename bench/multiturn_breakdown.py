"""Where the time to first token of each turn of a multi-turn image chat goes, server
side: the server runs in this process (Hypercorn on loopback, as in the tests), the
client is bench/multiturn.py's, and wrappers time the request's stages.

    python bench/multiturn_breakdown.py --model DIR [--image-size 896] [--turns 3] \
        [--conversations 3] [--prefix-cache-size 0]

Columns (ms, per request; a stage missing from the code is left out): the client's TTFT,
then time spent during the whole request in: body JSON decode (event loop),
preprocessing (images, template, tokens: CPU pool), prefill start (inputs to MLX, vision
tower or its cache, prefix-cache lookup) and all prefill steps, queueing decode steps
and reading them back (all --max-tokens of them). The first conversation warms up and
is not shown.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import socket
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from multiturn import image_url, ttft  # noqa: E402

from vlm_serve.api import chat, state  # noqa: E402
from vlm_serve.config import ServerConfig  # noqa: E402
from vlm_serve.engine import prefill, scheduler  # noqa: E402

TOTALS: dict[str, float] = collections.defaultdict(float)


class Server:
    """The real app under Hypercorn on a loopback port, in a thread of this process."""

    def __init__(self, config: ServerConfig):
        from hypercorn.asyncio import serve

        from vlm_serve.api.app import create_app
        from vlm_serve.server import build_engine, hypercorn_config

        self.engine = build_engine(config)
        app = create_app(self.engine, config)
        self.base_url = f"http://{config.host}:{config.port}"
        self._stop = threading.Event()

        async def run():
            stopped = asyncio.Event()
            asyncio.get_running_loop().run_in_executor(None, lambda: (self._stop.wait(), stopped.set()))
            await serve(app, hypercorn_config(config), shutdown_trigger=stopped.wait)

        self._thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
        self._thread.start()
        for _ in range(600):
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("server did not start")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.engine.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(owner, name: str, label: str) -> None:
    original = getattr(owner, name, None)
    if original is None:
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def timed_async(owner, name: str, label: str) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    async def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            TOTALS[label] += time.perf_counter() - start

    setattr(owner, name, wrapper)


def first_text_marks() -> None:
    """Server-side times from the body's arrival to the first token and to the first
    text a client sees, and how many tokens that took (a token can be part of a
    character, held back until the character is whole)."""
    from vlm_serve.engine import detokenize

    read_json, add_token = state.read_json, detokenize.TextAssembler.add_token

    async def arrived(*args, **kwargs):
        MARKS.clear()
        MARKS["arrival"] = time.perf_counter()
        return await read_json(*args, **kwargs)

    def token(self, token_id):
        text = add_token(self, token_id)
        now = time.perf_counter()
        MARKS["tokens"] = MARKS.get("tokens", 0) + 1
        MARKS.setdefault("first token", now)
        if text and "first text" not in MARKS:
            MARKS["first text"] = now
            MARKS["tokens to text"] = MARKS["tokens"]
        return text

    state.read_json = arrived
    chat.read_json = arrived
    detokenize.TextAssembler.add_token = token


MARKS: dict[str, float] = {}


def instrument() -> None:
    first_text_marks()
    timed(state, "decode_json", "JSON decode")
    timed_async(chat, "prepare_chat_request", "preprocess")
    timed(prefill.Prefill, "start", "prefill: inputs + vision")
    timed(prefill.Prefill, "step", "prefill: all steps")
    timed(scheduler.Scheduler, "_launch", "decode: queue steps")
    timed(scheduler.Scheduler, "_process", "decode: read back")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--image-size", type=int, default=896)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prefix-cache-size", type=int, default=ServerConfig.prefix_cache_size)
    parser.add_argument("--image-cache-size", type=int, default=None, help="default: the server's")
    parser.add_argument("--result-json")
    args = parser.parse_args()

    instrument()
    extra = {} if args.image_cache_size is None else {"image_cache_size": args.image_cache_size}
    config = ServerConfig(model=args.model, port=free_port(), log_level="warning", access_log=False,
                          prefix_cache_size=args.prefix_cache_size, **extra)
    server = Server(config)
    rows = []
    try:
        with httpx.Client(timeout=600) as client:
            for c in range(args.conversations + 1):
                messages = [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image_url(args.image_size, 100 + c)}},
                    {"type": "text", "text": "Describe this picture in detail."}]}]
                for turn in range(1, args.turns + 1):
                    TOTALS.clear()
                    sent = time.perf_counter()
                    seconds, answer, cached = ttft(client, server.base_url + "/v1", messages, args.max_tokens)
                    if c:
                        marks = {f"server: {k}": 1000 * (MARKS[k] - MARKS["arrival"])
                                 for k in ("first token", "first text") if k in MARKS}
                        # Client and server share this process's clock.
                        marks["sent -> handler"] = 1000 * (MARKS["arrival"] - sent)
                        marks["first text -> client"] = 1000 * (sent + seconds - MARKS.get("first text", sent + seconds))
                        rows.append({"conversation": c, "turn": turn, "ttft": 1000 * seconds, "cached": cached,
                                     **marks, "tokens to text": MARKS.get("tokens to text", 0),
                                     **{k: 1000 * v for k, v in TOTALS.items()}})
                    messages += [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": f"Tell me more, part {turn + 1}."}]
    finally:
        server.stop()
    stages = list(dict.fromkeys(k for r in rows for k in r if k not in ("conversation", "turn")))
    print("| conversation | turn | " + " | ".join(stages) + " |")
    print("|---|---|" + "---|" * len(stages))
    for r in rows:
        print(f"| {r['conversation']} | {r['turn']} | " + " | ".join(f"{r.get(k, 0):.1f}" for k in stages) + " |")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
