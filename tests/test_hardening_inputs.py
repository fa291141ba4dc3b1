"""Hostile and malformed input over real HTTP: every client mistake is a 4xx in OpenAI's
error envelope naming the field, the server keeps serving, and no response ever carries
a non-finite number."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import data_url, make_image

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
DEPTH = 100  # vlm_serve.api.schemas.MAX_JSON_DEPTH


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("gemma3")


def user(content):
    return [{"role": "user", "content": content}]


def chat(**fields):
    return {"messages": user("hi"), "max_tokens": 2, **fields}


def raw_chat(fields: str) -> bytes:
    """A chat body with ``fields`` spliced in verbatim (for literals json.dumps refuses)."""
    return ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + fields + "}").encode()


def call(function, **extra):
    return {"id": "call_1", "type": "function", "function": function, **extra}


def after_call(calls):
    """A conversation whose assistant turn carries ``calls``."""
    return {"messages": [{"role": "user", "content": "weather?"},
                         {"role": "assistant", "content": None, "tool_calls": calls},
                         {"role": "tool", "tool_call_id": "call_1", "content": "21C"}],
            "max_tokens": 2, "tools": TOOLS}


IMAGE = data_url(make_image(20, 20))

# (id, path, body: dict or raw bytes, param the error must name)
BATTERY = [
    # Body-level: nesting, non-finite literals, what json.loads itself refuses.
    ("nested past the recursion limit", CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("nested past the depth limit", CHAT,
     raw_chat('"chat_template_kwargs": ' + '{"a": ' * DEPTH + "1" + "}" * DEPTH),
     "chat_template_kwargs" + ".a" * (DEPTH - 1)),
    ("NaN temperature", CHAT, raw_chat('"temperature": NaN'), "temperature"),
    ("Infinity top_p", CHAT, raw_chat('"top_p": Infinity'), "top_p"),
    ("-Infinity presence_penalty", CHAT, raw_chat('"presence_penalty": -Infinity'), "presence_penalty"),
    ("overflowing float", CHAT, raw_chat('"frequency_penalty": 1e999'), "frequency_penalty"),
    ("NaN repetition_penalty", CHAT, raw_chat('"repetition_penalty": NaN'), "repetition_penalty"),
    ("NaN min_p", CHAT, raw_chat('"min_p": NaN'), "min_p"),
    ("NaN logit_bias value", CHAT, raw_chat('"logit_bias": {"5": NaN}'), "logit_bias.5"),
    ("NaN in an unknown field", CHAT, raw_chat('"extra": [1, NaN]'), "extra[1]"),
    ("NaN in completions", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}', "temperature"),
    ("integer of 5000 digits", CHAT, raw_chat('"seed": 1' + "0" * 5000), None),
    ("invalid utf-8", CHAT, raw_chat('"user": "\xff"').replace("\xff".encode(), b"\xff"), None),
    ("lone surrogate in content", CHAT,
     b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}', "messages[0].content"),
    ("lone surrogate in a text part", CHAT,
     b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}', "messages[0].content[0].text"),
    ("lone surrogate in a key", CHAT, raw_chat('"logit_bias": {"\\udc00": 1}'), "logit_bias"),
    ("body an array", CHAT, b"[1, 2]", None),
    ("empty body", CHAT, b"", None),
    # Integers beyond what the engine holds, and out-of-range sampling fields.
    ("top_k beyond int32", CHAT, chat(top_k=2**40), "top_k"),
    ("top_k below -1", CHAT, chat(top_k=-2), "top_k"),
    ("top_k a float", CHAT, chat(top_k=1.5), "top_k"),
    ("max_tokens beyond int32", CHAT, chat(max_tokens=2**40), "max_tokens"),
    ("max_tokens negative", CHAT, chat(max_tokens=-1), "max_tokens"),
    ("max_completion_tokens zero", CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    ("max_completion_tokens huge", CHAT, chat(max_completion_tokens=2**63), "max_completion_tokens"),
    ("seed beyond int64", CHAT, chat(seed=2**70), "seed"),
    ("n huge", CHAT, chat(n=2**40), "n"),
    ("top_logprobs negative", CHAT, chat(top_logprobs=-1), "top_logprobs"),
    ("top_logprobs huge", CHAT, chat(top_logprobs=2**40), "top_logprobs"),
    ("logit_bias key past vocab", CHAT, chat(logit_bias={str(2**40): 1}), "logit_bias"),
    ("logit_bias value too big", CHAT, chat(logit_bias={"5": 1e6}), "logit_bias"),
    ("logit_bias value a string", CHAT, chat(logit_bias={"5": "x"}), "logit_bias"),
    ("stop_token_ids beyond vocab", CHAT, chat(stop_token_ids=[2**40]), "stop_token_ids"),
    ("stop_token_ids not a list", CHAT, chat(stop_token_ids="x"), "stop_token_ids"),
    ("temperature negative", CHAT, chat(temperature=-0.5), "temperature"),
    ("temperature too high", CHAT, chat(temperature=1e6), "temperature"),
    ("top_p zero", CHAT, chat(top_p=0), "top_p"),
    ("top_p over one", CHAT, chat(top_p=1.5), "top_p"),
    ("min_p over one", CHAT, chat(min_p=2), "min_p"),
    ("repetition_penalty zero", CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    ("presence_penalty over two", CHAT, chat(presence_penalty=3), "presence_penalty"),
    ("frequency_penalty under minus two", CHAT, chat(frequency_penalty=-3), "frequency_penalty"),
    ("include_usage a string", CHAT, chat(stream=True, stream_options={"include_usage": "yes"}),
     "stream_options.include_usage"),
    ("completions top_k beyond int32", COMPLETIONS, {"prompt": "x", "top_k": 2**40}, "top_k"),
    ("completions max_tokens huge", COMPLETIONS, {"prompt": "x", "max_tokens": 2**40}, "max_tokens"),
    # tool_choice and tools.
    ("tool_choice function a string", CHAT, chat(tools=TOOLS, tool_choice={"type": "function", "function": "get_weather"}),
     "tool_choice"),
    ("tool_choice a number", CHAT, chat(tools=TOOLS, tool_choice=5), "tool_choice"),
    ("tool_choice name not a string", CHAT, chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": 5}}),
     "tool_choice"),
    ("tools not a list", CHAT, chat(tools={"a": 1}), "tools"),
    ("tool function a string", CHAT, chat(tools=[{"type": "function", "function": "f"}]), "tools[0]"),
    ("tool description not a string", CHAT,
     chat(tools=[{"type": "function", "function": {"name": "f", "description": ["x"]}}]), "tools[0].function.description"),
    # Message shapes.
    ("tool_calls a string", CHAT, after_call("get_weather()"), "messages[1].tool_calls"),
    ("tool_calls of non-objects", CHAT, after_call(["get_weather"]), "messages[1].tool_calls[0]"),
    ("tool_call function a string", CHAT, after_call([call("get_weather")]), "messages[1].tool_calls[0]"),
    ("tool_call without a name", CHAT, after_call([call({"arguments": "{}"})]), "messages[1].tool_calls[0].function.name"),
    ("tool_call arguments a number", CHAT, after_call([call({"name": "get_weather", "arguments": 5})]),
     "messages[1].tool_calls[0].function.arguments"),
    ("tool_call arguments a list", CHAT, after_call([call({"name": "get_weather", "arguments": [1]})]),
     "messages[1].tool_calls[0].function.arguments"),
    ("tool_call id not a string", CHAT, after_call([{**call({"name": "get_weather", "arguments": "{}"}), "id": 7}]),
     "messages[1].tool_calls[0].id"),
    ("tool_call of another type", CHAT, after_call([call({"name": "get_weather"}, type="code")]),
     "messages[1].tool_calls[0]"),
    ("tool_calls on a user message", CHAT,
     {"messages": [{"role": "user", "content": "x", "tool_calls": []}], "max_tokens": 2}, "messages[0].tool_calls"),
    ("tool_call_id not a string", CHAT,
     {**after_call([call({"name": "get_weather", "arguments": "{}"})]),
      "messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": 1, "content": "21C"}]},
     "messages[1].tool_call_id"),
    ("name not a string", CHAT, {"messages": [{"role": "user", "content": "x", "name": {"a": 1}}]}, "messages[0].name"),
    ("messages an object", CHAT, {"messages": {"role": "user"}}, "messages"),
    ("message a string", CHAT, {"messages": ["hi"]}, "messages[0]"),
    ("role missing", CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("role unknown", CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("role a list", CHAT, {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("user content missing", CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("tool content missing", CHAT, {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "a"}]},
     "messages[1].content"),
    ("content a number", CHAT, {"messages": user(5)}, "messages[0].content"),
    ("content an object", CHAT, {"messages": user({"type": "text", "text": "x"})}, "messages[0].content"),
    ("content part a string", CHAT, {"messages": user(["hi"])}, "messages[0].content[0]"),
    ("content part of unknown type", CHAT, {"messages": user([{"type": "audio", "audio": "x"}])}, "messages[0].content[0].type"),
    ("content part type a list", CHAT, {"messages": user([{"type": ["text"], "text": "x"}])}, "messages[0].content[0].type"),
    ("text part without text", CHAT, {"messages": user([{"type": "text", "text": 5}])}, "messages[0].content[0].text"),
    # An image placeholder typed into the text stands for an image the request lacks.
    ("image placeholder typed beside an image", CHAT,
     {"messages": user([{"type": "image_url", "image_url": IMAGE},
                        {"type": "text", "text": "what is <image_soft_token> here"}])},
     "messages[0].content"),
    ("image placeholder typed in an earlier turn", CHAT,
     {"messages": [{"role": "user", "content": "see <image_soft_token>"},
                   {"role": "assistant", "content": "ok"},
                   {"role": "user", "content": [{"type": "image_url", "image_url": IMAGE}]}]},
     "messages[0].content"),
    ("image_url a number", CHAT, {"messages": user([{"type": "image_url", "image_url": 5}])},
     "messages[0].content[0].image_url.url"),
    ("image_url without url", CHAT, {"messages": user([{"type": "image_url", "image_url": {"detail": "low"}}])},
     "messages[0].content[0].image_url.url"),
    ("image in an assistant message", CHAT,
     {"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"type": "image_url", "image_url": IMAGE}]}]},
     "messages[1].content[0]"),
    ("response_format a string", CHAT, chat(response_format="json"), "response_format"),
    ("response_format schema unusable", CHAT,
     chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 5}}}), "response_format.json_schema"),
]


def assert_envelope(r: httpx.Response, param: str | None) -> None:
    assert 400 <= r.status_code < 500, f"{r.status_code} {r.text[:300]}"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param, error


def assert_still_serving(server) -> None:
    good = server.client().chat.completions.create(model="tiny-gemma3", messages=user("good"), max_tokens=2)
    assert good.usage.completion_tokens == 2


@pytest.mark.parametrize("path, body, param", [c[1:] for c in BATTERY], ids=[c[0] for c in BATTERY])
def test_bad_request_is_a_4xx_naming_the_field_then_serving_goes_on(server, path, body, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.base_url + path, content=content, timeout=30,
                   headers={"content-type": "application/json"})
    assert_envelope(r, param)
    assert_still_serving(server)


@pytest.mark.parametrize("body", [
    chat(top_k=-1),  # vLLM's "disabled"
    chat(top_k=2**31 - 1, seed=-(2**63), temperature=2, top_p=1e-9, min_p=1, repetition_penalty=10),
    chat(stop_token_ids=[1], logit_bias={"5": -100}),
    {"messages": user([{"type": "image_url", "image_url": IMAGE}, {"type": "text", "text": "x"}]), "max_tokens": 2},
    after_call([call({"name": "get_weather", "arguments": {"city": "Paris"}})]),
    after_call([call({"name": "get_weather", "arguments": '{"city": "Paris"}'})]),
    raw_chat('"chat_template_kwargs": ' + '{"a": ' * (DEPTH - 3) + "1" + "}" * (DEPTH - 3)),
    b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00 \\\\ud800"}], "max_tokens": 2}',
], ids=["top_k -1", "edges of every range", "stop_token_ids", "image_url a bare string",
        "arguments an object", "arguments a string", "nested just under the limit",
        "surrogate pair and an escaped backslash"])
def test_edge_values_that_are_fine(server, body):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.base_url + CHAT, content=content, timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("kwargs, param", [
    ({"extra_body": {"top_k": 2**40}}, "top_k"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": "oops"}]},
     "messages[1].tool_calls"),
], ids=["top_k", "tool_choice", "tool_calls"])
def test_openai_client_gets_bad_request_errors(server, kwargs, param):
    client = server.client(max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{"model": "tiny-gemma3", "messages": user("x"), "max_tokens": 2, **kwargs})
    assert info.value.status_code == 400 and info.value.body["param"] == param
    assert_still_serving(server)


def _strict(text: str):
    def refuse(name):
        raise AssertionError(f"non-finite number {name} in a response")
    return json.loads(text, parse_constant=refuse)


def _logprobs(choice: dict) -> list[float]:
    content = (choice.get("logprobs") or {}).get("content") or []
    return [v for e in content for v in [e["logprob"]] + [t["logprob"] for t in e["top_logprobs"]]]


def test_json_mode_logprobs_are_finite_streamed_and_not(server):
    # Under a grammar most of the vocabulary is masked (-inf): top_logprobs reach them.
    body = {"messages": user("give me json"), "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 5, "response_format": {"type": "json_object"}}
    r = httpx.post(server.base_url + CHAT, json=body, timeout=60)
    assert r.status_code == 200, r.text
    whole = _logprobs(_strict(r.text)["choices"][0])
    assert whole and all(-9999.0 <= v <= 0 for v in whole)

    streamed = []
    with httpx.stream("POST", server.base_url + CHAT, json={**body, "stream": True}, timeout=60) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = _strict(line[len("data: "):])
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            streamed += _logprobs(choice)
    assert streamed == whole
    assert -9999.0 in whole  # masked tokens were reported, floored as OpenAI does
