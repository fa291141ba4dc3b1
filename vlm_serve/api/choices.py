"""Several choices in one response (``n``, several completion prompts).

Each choice is its own request in the engine and its own row of the batch. The n
copies of one prompt are submitted together, so the prompt is prefilled once and each
copy starts from that prefill with its own seed. Their events are merged into one
stream, told apart by request id.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from typing import AsyncIterator

from ..engine.engine import EngineBusy
from ..engine.types import GenerationEvent, PreparedRequest
from .errors import APIError
from .generation import Finished, run_to_end, start
from .state import AppState


def fan_out(prompts: list[PreparedRequest], n: int, request_id: str) -> list[PreparedRequest]:
    """``n`` copies of each prompt, in choice order (prompt by prompt). A lone choice
    keeps ``request_id``; several get ``<request_id>-<index>``. Copy ``j`` of a seeded
    prompt samples with ``seed + j``: choices differ yet stay reproducible."""
    if len(prompts) == 1 and n == 1:
        return [replace(prompts[0], request_id=request_id)]
    out = []
    for p, prompt in enumerate(prompts):
        for j in range(n):
            seed = prompt.sampling.seed
            sampling = replace(prompt.sampling, seed=None if seed is None else seed + j)
            out.append(replace(prompt, request_id=f"{request_id}-{p * n + j}", sampling=sampling))
    return out


def start_all(state: AppState, choices: list[PreparedRequest], n: int = 1) -> list[AsyncIterator[GenerationEvent]]:
    """Submit every choice, the ``n`` copies of each prompt together (one prefill); if
    the engine refuses some (at capacity), none stays."""
    if len(choices) == 1:
        return [start(state, choices[0])]
    streams = []
    try:
        for i in range(0, len(choices), n):
            streams += _start_copies(state, choices[i:i + n])
    except BaseException:
        for prepared in choices[: len(streams)]:
            state.engine.cancel(prepared.request_id)
        raise
    return streams


def _start_copies(state: AppState, copies: list[PreparedRequest]) -> list[AsyncIterator[GenerationEvent]]:
    arrived = time.monotonic()
    try:
        streams = state.engine.submit_copies(copies)
    except EngineBusy as exc:  # as AppState.submit answers for one request
        raise APIError(503, "the server is at capacity; retry shortly", code="server_busy",
                       headers={"Retry-After": "1"}) from exc
    return [state.metrics.observe(s, arrived) for s in streams]


async def run_all(streams: list[AsyncIterator[GenerationEvent]]) -> list[Finished]:
    """Every choice to its end. The first failure ends the others (their rows leave
    the batch) and is raised."""
    tasks = [asyncio.ensure_future(run_to_end(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def merged(streams: list[AsyncIterator[GenerationEvent]]) -> AsyncIterator[GenerationEvent]:
    """The events of every choice as they come (one choice: its own stream, with no
    layer between it and the response, which runs per token)."""
    return streams[0] if len(streams) == 1 else _interleaved(streams)


async def _interleaved(streams: list[AsyncIterator[GenerationEvent]]) -> AsyncIterator[GenerationEvent]:
    """Each stream is asked for its next event only once its last one is taken, so a
    slow reader still gets them folded."""
    iterators = [s.__aiter__() for s in streams]
    pending = {asyncio.ensure_future(it.__anext__()): it for it in iterators}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                iterator = pending.pop(future)
                try:
                    event = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterator.__anext__())] = iterator
                yield event
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for iterator in iterators:
            await iterator.aclose()


class UsageTally:
    """OpenAI usage over all choices: each prompt counted once (as OpenAI does for
    ``n``), completion tokens summed over the choices."""

    def __init__(self, choices: list[PreparedRequest], n: int):
        self.n = n
        self.index = {c.request_id: i for i, c in enumerate(choices)}
        self.prompt = [c.num_prompt_tokens for c in choices[::n]]
        self.cached = [0] * len(self.prompt)
        self.completion = [0] * len(choices)
        self.unfinished = len(choices)

    def add(self, event: GenerationEvent) -> int:
        """Count ``event``; returns the index of its choice."""
        i = self.index[event.request_id]
        self.completion[i] = event.completion_tokens
        if event.finished:
            self.unfinished -= 1
            if i % self.n == 0:  # the first copy of a prompt reports its cache hits
                self.cached[i // self.n] = event.stats.get("cached_tokens", 0)
        return i

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt), sum(self.completion)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached)},
        }
