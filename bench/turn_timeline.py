"""Where one image-chat request's time goes on its way to the first text, stage by stage,
on the wall clock and on the CPU of the thread that ran the stage: the server runs in
this process (as in bench/multiturn_breakdown.py) and its client in another, wrappers
mark each stage's start and end, and each conversation sends turn 1 (a new image) and
turn 2 (the same image again, after the answer and a new question).

    python bench/turn_timeline.py --model DIR [--image-size 896] [--conversations 6]

Per request: the client's TTFT, the server's time from the body's arrival to the first
text (and the client's time on either side of it: from its request's start to the
server's arrival, and from the first text to the client's first token), and "stage
wall/cpu" in ms for the stages on that path (a stage that runs more than once adds up).
A stage whose CPU time is near its wall time kept its thread busy: ``async_eval`` that
does so is MLX launching the queued work on the host, not waiting for the device. With
--detail, the last conversation's marks are listed in order. The first conversation
warms up and is not shown.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import inspect
import multiprocessing
import sys
import time
from pathlib import Path

import httpx
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).parent))
from multiturn import image_url, ttft  # noqa: E402
from multiturn_breakdown import Server, free_port  # noqa: E402

from vlm_serve.api import chat, state  # noqa: E402
from vlm_serve.config import ServerConfig  # noqa: E402
from vlm_serve.engine import batch, detokenize, prefill, prefix_cache, sampling, scheduler  # noqa: E402
from vlm_serve.preprocess import prompt  # noqa: E402

MARKS: list[tuple[float, str, float]] = []  # (wall clock, label, this thread's CPU time)
SUMMARY = ("JSON decode", "load images", "processor", "prefill start", "prefill pass",
           "join", "async_eval", "keep prefix", "batch add", "launch step")


def mark(label: str) -> None:
    MARKS.append((time.perf_counter(), label, time.thread_time()))


def timed(owner, name: str, label: str) -> None:
    original = getattr(owner, name)
    if inspect.iscoroutinefunction(original):
        @functools.wraps(original)
        async def wrapper(*args, **kwargs):
            mark(label + " >")
            try:
                return await original(*args, **kwargs)
            finally:
                mark(label + " <")
    else:
        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            mark(label + " >")
            try:
                return original(*args, **kwargs)
            finally:
                mark(label + " <")
    setattr(owner, name, wrapper)


def instrument() -> None:
    read_json, add_token = state.read_json, detokenize.TextAssembler.add_token

    async def arrived(*args, **kwargs):
        mark("arrival")
        return await read_json(*args, **kwargs)

    def token(self, token_id):
        text = add_token(self, token_id)
        if text:
            mark("text")
        return text

    state.read_json = chat.read_json = arrived
    detokenize.TextAssembler.add_token = token
    for owner, name, label in [
        (state, "decode_json", "JSON decode"), (state.AppState, "load_images", "load images"),
        (prompt, "render_chat", "chat template"), (prompt, "_process", "processor"),
        (prefill.Prefill, "start", "prefill start"), (prefill.Prefill, "step", "prefill pass"),
        (prefix_cache.PrefixCache, "lookup", "prefix lookup"),
        (scheduler.Scheduler, "_join", "join"), (sampling.BatchSampler, "sample", "sample"),
        (prefill.Prefill, "remember", "keep prefix"), (batch.Batch, "add", "batch add"),
        (scheduler.Scheduler, "_launch", "launch step"), (scheduler.Scheduler, "_process", "read back"),
        (mx, "async_eval", "async_eval"),
    ]:
        timed(owner, name, label)


def spans(marks: list, until: float) -> dict[str, tuple[float, float]]:
    """Total wall and CPU ms per stage, over the stages that ended by ``until``."""
    out, started = {}, {}
    for wall, label, cpu in marks:
        if wall > until:
            break
        name, end = label[:-2], label[-1]
        if end == ">":
            started[name] = (wall, cpu)
        elif end == "<" and name in started:
            wall0, cpu0 = started.pop(name)
            total = out.get(name, (0.0, 0.0))
            out[name] = (total[0] + 1000 * (wall - wall0), total[1] + 1000 * (cpu - cpu0))
    return out


def client_ttft(base_url: str, messages: list, max_tokens: int) -> tuple[float, str, int, list]:
    """``ttft`` in the client's process, with its clock: ``perf_counter`` is the
    system's monotonic clock on Linux, the same in both processes."""
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=600)
    clock = []
    return (*ttft(_CLIENT, base_url, messages, max_tokens, clock), clock)


_CLIENT: httpx.Client | None = None  # the client process's connection


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--image-size", type=int, default=896)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--detail", action="store_true", help="list the last conversation's marks")
    args = parser.parse_args()

    instrument()
    config = ServerConfig(model=args.model, port=free_port(), log_level="warning", access_log=False)
    server = Server(config)
    # The client runs in a process of its own: in this one, its sending of a
    # multi-megabyte body would hold the interpreter lock against the server's threads.
    client = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    try:
        with client:
            for c in range(args.conversations):
                messages = [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image_url(args.image_size, 100 + c)}},
                    {"type": "text", "text": "Describe this picture in detail."}]}]
                for turn in (1, 2):
                    MARKS.clear()
                    seconds, answer, cached, (sent, first) = client.submit(
                        client_ttft, server.base_url + "/v1", messages, args.max_tokens).result()
                    messages += [{"role": "assistant", "content": answer},
                                 {"role": "user", "content": f"Tell me more, part {turn + 1}."}]
                    if not c:
                        continue
                    start = next(w for w, label, _ in MARKS if label == "arrival")
                    text = next((w for w, label, _ in MARKS if label == "text"), start)
                    parts = spans(MARKS, text)
                    print(f"conversation {c} turn {turn}: ttft {1000 * seconds:.1f}, server "
                          f"{1000 * (text - start):.1f} (sent to arrival {1000 * (start - sent):.1f}, text "
                          f"to client {1000 * (first - text):.1f}), cached {cached} | "
                          + ", ".join(f"{k} {parts[k][0]:.1f}/{parts[k][1]:.1f}" for k in SUMMARY if k in parts))
                    if args.detail and c == args.conversations - 1:
                        for wall, label, cpu in MARKS:
                            print(f"{1000 * (wall - start):9.2f} ms  cpu {1000 * cpu:10.2f}  {label}")
                            if label == "text":
                                break
    finally:
        server.stop()


if __name__ == "__main__":
    main()
