"""API conveniences over real HTTP: n choices, min_tokens, completions echo and token-id
prompts, continuous usage, /tokenize and /detokenize, one model's card."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

MODEL = "tiny-gemma3"


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("gemma3")


@pytest.fixture(scope="module")
def eos(server) -> int:
    return min(server.engine.loaded.eos_token_ids)


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


# -- n ------------------------------------------------------------------------------


def test_n_choices_are_the_seeded_single_requests(server):
    client = server.client()
    args = dict(model=MODEL, messages=user("Tell me a story"), max_tokens=8, temperature=1.0)
    r = client.chat.completions.create(n=3, seed=7, **args)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert len(set(texts)) > 1  # different seeds, different samples
    # Choice i is the request with seed 7 + i: reproducible, one by one.
    singles = [client.chat.completions.create(seed=7 + i, **args) for i in range(3)]
    assert texts == [s.choices[0].message.content for s in singles]
    assert client.chat.completions.create(n=3, seed=7, **args).choices[1].message.content == texts[1]
    # Usage as OpenAI counts it: the prompt once, every choice's tokens.
    assert r.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_n_choices_stream_with_their_index(server):
    client = server.client()
    args = dict(model=MODEL, messages=user("Once upon a time"), max_tokens=6, temperature=1.0, seed=3, n=2)
    whole = client.chat.completions.create(**args)
    texts, reasons, usage = {}, {}, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {0: "length", 1: "length"}
    assert usage.completion_tokens == whole.usage.completion_tokens == 12
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_n_is_capped(server):
    r = post(server, "/v1/chat/completions", {"messages": user("x"), "n": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = post(server, "/v1/completions", {"prompt": "x", "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# -- min_tokens -----------------------------------------------------------------------


def test_min_tokens_holds_back_eos(server, eos):
    client = server.client()
    forced_end = dict(model=MODEL, messages=user("Hi"), max_tokens=20, temperature=0, logit_bias={str(eos): 100})
    ends_at_once = client.chat.completions.create(**forced_end)
    assert ends_at_once.usage.completion_tokens == 1 and ends_at_once.choices[0].finish_reason == "stop"
    held = client.chat.completions.create(extra_body={"min_tokens": 5}, **forced_end)
    # EOS is masked for the first five tokens, then the bias makes it the sixth.
    assert held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    assert held.choices[0].message.content
    # Stop token ids are held back as well: a biased stop token ends the fifth.
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 9, "temperature": 0, "min_tokens": 4,
                                         "stop_token_ids": [50], "logit_bias": {"50": 100}})
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "stop"


def test_min_tokens_per_row_in_a_shared_batch(server, eos):
    """Rows with and without a minimum decode together; each keeps its own."""
    client = server.client()
    results = {}

    def run(name, min_tokens):
        extra = {"min_tokens": min_tokens} if min_tokens else {}
        results[name] = client.chat.completions.create(
            model=MODEL, messages=user(f"Hello {name}"), max_tokens=30, temperature=0,
            logit_bias={str(eos): 100}, extra_body=extra).usage.completion_tokens

    threads = [threading.Thread(target=run, args=(f"r{m}", m)) for m in (0, 3, 0, 9, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {"r0": 1, "r3": 4, "r9": 10, "r1": 2}


def test_min_tokens_validated(server):
    r = post(server, "/v1/chat/completions", {"messages": user("x"), "max_tokens": 3, "min_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    r = post(server, "/v1/chat/completions", {"messages": user("x"), "min_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"


# -- completions: echo, token-id prompts, several prompts -----------------------------------


def test_echo_prepends_the_prompt(server):
    client = server.client()
    args = dict(model=MODEL, prompt="Once upon a time", max_tokens=5, temperature=0)
    plain = client.completions.create(**args)
    echoed = client.completions.create(echo=True, **args)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    # Usage unchanged (cached prompt tokens aside: the second run reuses the first's).
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    chunks = [c.choices[0].text for c in client.completions.create(echo=True, stream=True, **args) if c.choices]
    assert chunks[0] == "Once upon a time" and "".join(chunks) == echoed.choices[0].text
    r = post(server, "/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_token_id_prompts_and_several_prompts(server):
    client = server.client()
    ids = post(server, "/tokenize", {"prompt": "Once upon a time"}).json()["tokens"]
    args = dict(model=MODEL, max_tokens=5, temperature=0)
    by_text = client.completions.create(prompt="Once upon a time", **args)
    by_ids = client.completions.create(prompt=ids, **args)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids) == by_text.usage.prompt_tokens
    echoed = client.completions.create(prompt=ids, echo=True, **args)
    assert echoed.choices[0].text.endswith("Once upon a time" + by_text.choices[0].text)

    other = client.completions.create(prompt="The sea", **args)
    several = client.completions.create(prompt=["Once upon a time", "The sea"], n=2, **args)
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert [c.text for c in several.choices] == [by_text.choices[0].text] * 2 + [other.choices[0].text] * 2
    assert several.usage.prompt_tokens == by_text.usage.prompt_tokens + other.usage.prompt_tokens
    assert several.usage.completion_tokens == 20
    lists = client.completions.create(prompt=[ids, ids[:3]], **args)
    assert len(lists.choices) == 2 and lists.choices[0].text == by_text.choices[0].text

    for bad in ([], [[]], [1, "a"], [[1, 2], "a"], [10**9], [-1]):
        r = post(server, "/v1/completions", {"prompt": bad, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", bad


def test_continuous_usage_on_every_chunk(server):
    client = server.client()
    for create, args in (
        (client.completions.create, {"prompt": "Once upon a time"}),
        (client.chat.completions.create, {"messages": user("Once upon a time")}),
    ):
        chunks = list(create(model=MODEL, max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}, **args))
        assert all(c.usage is not None for c in chunks)
        counts = [c.usage.completion_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 5
        assert len({c.usage.prompt_tokens for c in chunks}) == 1
        assert not chunks[-1].choices  # the closing usage chunk
    # Without include_usage it changes nothing (as in vLLM).
    plain = list(client.completions.create(model=MODEL, prompt="x", max_tokens=2, stream=True,
                                           stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)


# -- /tokenize, /detokenize, /v1/models/{id} ------------------------------------------------


def test_tokenize_and_detokenize(server):
    r = post(server, "/tokenize", {"prompt": "Hello there", "add_special_tokens": False}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == server.app.state.vlm.max_model_len
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": "Hello there"}
    with_bos = post(server, "/tokenize", {"prompt": "Hello there", "return_token_strs": True}).json()
    assert with_bos["count"] == r["count"] + 1 and with_bos["tokens"][1:] == r["tokens"]
    assert "".join(with_bos["token_strs"][1:]) == "Hello there"

    messages = user("What is in a name?")
    chat = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    counted = post(server, "/tokenize", {"messages": messages}).json()
    assert counted["count"] == chat.usage.prompt_tokens
    bare = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()
    assert bare["count"] < counted["count"] and counted["tokens"][: bare["count"]] == bare["tokens"]


def test_tokenize_errors(server):
    for path, body, param in (
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": "a", "messages": user("a")}, None),
        ("/tokenize", {"prompt": 3}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": [1, "a"]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ):
        r = post(server, path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        assert r.json()["error"]["param"] == param, (path, body)


def test_one_models_card(server):
    client = server.client()
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.get(server.base_url + "/v1/models/no/such-model")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found" and r.json()["error"]["type"] == "not_found_error"


def test_a_client_that_leaves_ends_every_choice(server):
    import time

    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": user("long"), "n": 3, "max_tokens": 2000, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        while "finish_reason" not in next(lines) or server.engine.in_flight < 3:
            pass  # streaming, all three choices running
    deadline = time.monotonic() + 10
    while server.engine.in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.in_flight == 0 and not server.scheduler.running
