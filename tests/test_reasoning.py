"""Gemma 4 thinking goes to ``reasoning_content``, streamed and not."""

from __future__ import annotations

import random

import pytest

from vlm_serve.api.reasoning import GEMMA4, ReasoningSplitter

from test_tool_calls import steer_to

TEXT = "<|channel>thought\nThe user greets me; answer kindly.<channel|>Hello there!"


def split(text: str, chunks: list[int]) -> tuple[str, str]:
    splitter, out, pos = ReasoningSplitter(GEMMA4), [], 0
    for n in chunks:
        out += splitter.feed(text[pos:pos + n])
        pos += n
    out += splitter.feed(text[pos:]) + splitter.finish()
    reasoning = "".join(t for f, t in out if f == "reasoning_content")
    content = "".join(t for f, t in out if f == "content")
    return reasoning, content


def test_splitter_any_chunking():
    rng = random.Random(0)
    for _ in range(200):
        chunks = [rng.randint(1, 6) for _ in range(40)]
        assert split(TEXT, chunks) == ("The user greets me; answer kindly.", "Hello there!")
    assert split("no thinking here <|chan", [3, 5]) == ("", "no thinking here <|chan")
    assert split("<|channel>unfinished thought", [4]) == ("unfinished thought", "")


@pytest.fixture
def server(start_server):
    return start_server("gemma4")


def test_reasoning_content_over_http(server, monkeypatch):
    tokenizer = server.engine.loaded.tokenizer
    steer_to(monkeypatch, tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<turn|>")])
    client = server.client()
    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model="tiny-gemma4", messages=messages, max_tokens=100,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = r.choices[0].message
    assert message.content == "Hello there!"
    assert message.model_extra["reasoning_content"] == "The user greets me; answer kindly."
    chunks = list(client.chat.completions.create(model="tiny-gemma4", messages=messages, max_tokens=100, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "Hello there!"
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == message.model_extra["reasoning_content"]
