"""n > 1 over real HTTP: the copies of a prompt share one prefill, and each is still
exactly the request it was when every copy prefilled on its own (greedy copies equal
n=1; copy i of a seeded request equals the request with seed + i)."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from vlm_serve.engine.types import PreparedRequest, SamplingParams

MODEL = "tiny-gemma3"


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def prefills(server) -> float:
    """The prompts prefilled so far, as /metrics reports them."""
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith("vlm_prefills_total{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("vlm_prefills_total not in /metrics")


@pytest.fixture(scope="module")
def server(start_server):
    # No prefix cache: a single request prefills its whole prompt, as each copy of an
    # n > 1 request did before copies shared a prefill.
    return start_server("gemma3", prefix_cache_size=0)


def test_greedy_copies_prefill_once_and_equal_n_1(server):
    client = server.client()
    args = dict(model=MODEL, messages=user("Tell me a long story"), max_tokens=12, temperature=0)
    one = client.chat.completions.create(**args)
    before = prefills(server)
    three = client.chat.completions.create(n=3, **args)
    assert prefills(server) - before == 1
    assert [c.message.content for c in three.choices] == [one.choices[0].message.content] * 3
    assert [c.finish_reason for c in three.choices] == [one.choices[0].finish_reason] * 3
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_seeded_copies_are_the_single_requests_with_their_seeds(server):
    client = server.client()
    args = dict(model=MODEL, messages=user("Once upon a time"), max_tokens=10, temperature=1.0, top_p=0.9)
    before = prefills(server)
    several = client.chat.completions.create(n=4, seed=11, **args)
    assert prefills(server) - before == 1
    before = prefills(server)
    singles = [client.chat.completions.create(seed=11 + i, **args) for i in range(4)]
    assert prefills(server) - before == 4
    texts = [c.message.content for c in several.choices]
    assert texts == [s.choices[0].message.content for s in singles]
    assert len(set(texts)) > 1  # their own seeds: different samples


def test_streamed_copies_and_completions_prefill_once_per_prompt(server):
    client = server.client()
    before = prefills(server)
    texts = {}
    for chunk in client.chat.completions.create(model=MODEL, messages=user("Stream it"), n=3, max_tokens=6,
                                                temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert prefills(server) - before == 1 and len(set(texts.values())) == 1 and len(texts) == 3
    before = prefills(server)
    r = client.completions.create(model=MODEL, prompt=["The sea", "A mountain"], n=3, max_tokens=5, temperature=0)
    assert prefills(server) - before == 2  # one per prompt
    assert len(r.choices) == 6 and len({c.text for c in r.choices[:3]}) == 1


def test_copies_beyond_the_batch_get_a_prefill_of_their_own(start_server):
    server = start_server("gemma3", max_num_seqs=2)
    client = server.client()
    args = dict(model=MODEL, messages=user("Count"), max_tokens=5, temperature=0)
    one = client.chat.completions.create(**args).choices[0].message.content
    before = prefills(server)
    r = client.chat.completions.create(n=5, **args)
    assert prefills(server) - before == 3  # 2 + 2 + 1 copies
    assert [c.message.content for c in r.choices] == [one] * 5


def test_a_cancelled_first_copy_leaves_the_prefill_to_the_others(server):
    """The copy that owns the shared prefill leaves at once (while the copies wait, or
    prefill, as the worker's timing has it): the next copy takes the prefill over and
    every other copy still finishes as the request does alone."""
    tokenizer = server.engine.loaded.tokenizer
    ids = np.asarray(tokenizer.encode("Cancel the first copy"), np.int32)

    def copy(i: int) -> PreparedRequest:
        return PreparedRequest(f"cancel-{i}", ids, SamplingParams(max_tokens=6, temperature=0.0))

    async def run() -> list[list[int]]:
        streams = server.engine.submit_copies([copy(i) for i in range(3)])
        server.engine.cancel("cancel-0")  # arrives right after the copies, before any turn

        async def tokens(stream):
            out, final = [], None
            async for event in stream:
                out += event.token_ids
                final = event
            return out, final.finish_reason.value

        return await asyncio.gather(*(tokens(s) for s in streams))

    async def alone() -> list[int]:
        [stream] = server.engine.submit_copies([copy(9)])
        out = []
        async for event in stream:
            out += event.token_ids
        return out

    results = asyncio.run_coroutine_threadsafe(run(), server._loop).result(60)
    expected = asyncio.run_coroutine_threadsafe(alone(), server._loop).result(60)
    assert results[0][1] == "cancelled"
    assert [r for r in results[1:]] == [(expected, "length")] * 2
