"""Sampling parameters end to end over HTTP, and every fixture family through the server."""

from __future__ import annotations

import pytest

from conftest import ARCHS, data_url, make_image


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("gemma3")


def ask(server, **kwargs):
    messages = kwargs.pop("messages", [{"role": "user", "content": "Say something about boats."}])
    return server.client().chat.completions.create(model="tiny-gemma3", messages=messages, **kwargs)


def test_same_seed_same_text_different_seed_differs(server):
    a = ask(server, max_tokens=16, temperature=1.0, seed=7).choices[0].message.content
    b = ask(server, max_tokens=16, temperature=1.0, seed=7).choices[0].message.content
    others = {ask(server, max_tokens=16, temperature=1.0, seed=s).choices[0].message.content for s in (8, 9, 10)}
    assert a == b
    assert others != {a}


def test_logit_bias_forces_a_token(server):
    tokenizer = server.engine.loaded.tokenizer
    token = tokenizer.encode(" river", add_special_tokens=False)[-1]
    r = ask(server, max_tokens=4, temperature=0, logit_bias={str(token): 100})
    assert r.choices[0].message.content == tokenizer.decode([token] * 4)


def test_stop_string_cuts_the_answer(server):
    full = ask(server, max_tokens=12, temperature=0).choices[0].message.content
    stop = full[4:7]
    cut = ask(server, max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == full[: full.find(stop)]


def test_penalties_change_a_repetitive_answer(server):
    plain = ask(server, max_tokens=24, temperature=0).choices[0].message.content
    penalised = ask(server, max_tokens=24, temperature=0, frequency_penalty=2.0, presence_penalty=2.0)
    assert penalised.choices[0].message.content != plain


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_serves_image_chat(arch, start_server):
    server = start_server(arch)
    client = server.client()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "What is here?"},
        {"type": "image_url", "image_url": {"url": data_url(make_image(56, 84, 3))}}]}]
    whole = client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=8, temperature=0)
    chunks = list(client.chat.completions.create(model=f"tiny-{arch}", messages=messages, max_tokens=8,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert whole.usage.completion_tokens >= 1
