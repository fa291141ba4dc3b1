"""``POST /v1/responses`` over HTTP with the openai client: the same generation as the
equivalent chat request, typed stream events, images, instructions, multi-turn input with
tool history, function tools, structured output, and errors naming the Responses field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from conftest import OneFault, data_url, make_image
from test_structured import SCHEMA, check
from test_tool_calls import steer_to

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                          "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def serve(start_server):
    servers = {}
    return lambda arch="gemma3": servers.get(arch) or servers.setdefault(arch, start_server(arch))


def _same_as_chat(serve, input, messages, **kwargs):
    """The response and the chat completion of the same conversation, greedy."""
    client = serve().client()
    tools = kwargs.pop("tools", None)
    chat_kwargs = {"tools": [CHAT_WEATHER]} if tools else {}
    r = client.responses.create(model="tiny-gemma3", input=input, max_output_tokens=12, temperature=0,
                                **({"tools": tools} if tools else {}), **kwargs)
    c = client.chat.completions.create(model="tiny-gemma3", messages=messages, max_tokens=12, temperature=0,
                                       **chat_kwargs)
    assert r.output_text == (c.choices[0].message.content or "")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (c.usage.prompt_tokens, c.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    finished = c.choices[0].finish_reason
    assert r.status == ("incomplete" if finished == "length" else "completed")
    if finished == "length":
        assert r.incomplete_details.reason == "max_output_tokens"
    return r


def test_text_input_matches_chat_streamed_and_not(serve):
    r = _same_as_chat(serve, "Hello there", [{"role": "user", "content": "Hello there"}])
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny-gemma3"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [p.type for p in message.content] == ["output_text"]

    events = list(serve().client().responses.create(model="tiny-gemma3", input="Hello there",
                                                    max_output_tokens=12, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     f"response.{r.status}"]
    assert events[0].response.status == "in_progress" and events[0].response.id == events[-1].response.id
    assert "".join(e.delta for e in deltas) == events[types.index("response.output_text.done")].text == r.output_text
    assert all(e.item_id == events[2].item.id for e in deltas)
    final = events[-1].response
    assert final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens

    # On the wire: an `event:` line naming each event, and no [DONE].
    with httpx.stream("POST", serve().base_url + "/v1/responses",
                      json={"input": "Hello there", "max_output_tokens": 3, "stream": True}) as raw:
        lines = [line for line in raw.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[-1] in ("response.completed", "response.incomplete")
    assert not any("[DONE]" in line for line in lines)


def test_image_input_and_instructions_match_chat(serve):
    url = data_url(make_image(40, 30))
    input = [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                          {"type": "input_image", "image_url": url, "detail": "auto"}]}]
    messages = [{"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                             {"type": "image_url", "image_url": {"url": url}}]}]
    r = _same_as_chat(serve, input, messages, instructions="Answer in one word.")
    assert r.instructions == "Answer in one word."
    # The image reached the model: without it the prompt is shorter.
    text_only = _same_as_chat(serve, "What is this?", [{"role": "user", "content": "What is this?"}])
    assert r.usage.input_tokens > text_only.usage.input_tokens


def test_multi_turn_input_with_tool_history_matches_chat(serve):
    args = json.dumps({"city": "Paris"})
    input = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp_c": 21}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},  # replayed by agents; dropped
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."}], "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 21}'},
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "And tomorrow?"},
    ]
    _same_as_chat(serve, input, messages, tools=[WEATHER])


@pytest.mark.parametrize("arch, text, end", [
    ("gemma3", 'Let me check.\n```tool_code\nget_weather(city="Paris", days=3)\n```', "<end_of_turn>"),
    ("qwen2_5_vl", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
                   "</tool_call>", "<|im_end|>"),
])
def test_function_tools_streamed_and_not(arch, text, end, serve, monkeypatch):
    server = serve(arch)
    tokenizer = server.engine.loaded.tokenizer
    steer_to(monkeypatch, tokenizer.encode(text, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(end)])
    client = server.client()
    ask = {"model": f"tiny-{arch}", "input": "What's the weather in Paris for 3 days?", "tools": [WEATHER],
           "max_output_tokens": 200}
    r = client.responses.create(**ask)
    assert r.status == "completed" and [item.type for item in r.output] == ["message", "function_call"]
    message, call = r.output
    assert message.content[0].text == "Let me check."
    assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris", "days": 3}
    assert r.tools[0].name == "get_weather"

    # The SDK's own stream helper checks the event sequence and rebuilds the response.
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[-1] == "response.completed" and "response.output_text.delta" in types
    call_events = types[types.index("response.output_item.done") + 1:]
    assert call_events[0] == "response.output_item.added" and call_events[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    arg_deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(arg_deltas) == {"city": "Paris", "days": 3}
    [streamed_call] = [item for item in final.output if item.type == "function_call"]
    assert (streamed_call.name, json.loads(streamed_call.arguments)) == ("get_weather", {"city": "Paris", "days": 3})

    # The call and its result go back as input items; the conversation continues.
    followup = [{"role": "user", "content": ask["input"]}, call.model_dump(exclude_none=True),
                {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 21}'}]
    again = client.responses.create(**{**ask, "input": followup})
    assert again.output[-1].type == "function_call"

    # tool_choice "none": the same text is plain output.
    plain = client.responses.create(**ask, tool_choice="none")
    assert [item.type for item in plain.output] == ["message"] and "get_weather" in plain.output_text

    # "required" and a named function are enforced by a grammar: the reply is the call alone
    # (steered to the call without its prose, which the grammar would refuse).
    call_text = text[text.index("```" if arch == "gemma3" else "<tool_call>"):]
    steer_to(monkeypatch, tokenizer.encode(call_text, add_special_tokens=False))
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        forced = client.responses.create(**ask, tool_choice=choice)
        assert [item.type for item in forced.output] == ["function_call"]
        assert json.loads(forced.output[0].arguments) == {"city": "Paris", "days": 3}


def test_thinking_is_a_reasoning_item(serve, monkeypatch):
    from test_reasoning import TEXT

    server = serve("gemma4")
    tokenizer = server.engine.loaded.tokenizer
    steer_to(monkeypatch, tokenizer.encode(TEXT, add_special_tokens=False) + [tokenizer.convert_tokens_to_ids("<turn|>")])
    ask = {"model": "tiny-gemma4", "input": "hi", "max_output_tokens": 100,
           "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    r = server.client().responses.create(**ask)
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "The user greets me; answer kindly."
    assert r.output_text == "Hello there!"
    with server.client().responses.stream(**ask) as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert "response.reasoning_text.delta" in types and "response.reasoning_text.done" in types
    assert final.output_text == "Hello there!" and final.output[0].content[0].text == reasoning.content[0].text
    # Logprobs are the message's tokens only, not the thinking's or its markers'.
    with_logprobs = server.client().responses.create(**ask, include=["message.output_text.logprobs"])
    assert "".join(lp.token for lp in with_logprobs.output[1].content[0].logprobs) == "Hello there!"


LOGPROBS = ["message.output_text.logprobs"]


def test_logprobs_on_output_text_match_chat_streamed_and_not(serve):
    client = serve().client()
    ask = dict(model="tiny-gemma3", input="Tell me a story", max_output_tokens=8, temperature=0)
    r = client.responses.create(**ask, include=LOGPROBS, top_logprobs=3)
    assert r.top_logprobs == 3
    [part] = r.output[0].content
    chat = client.chat.completions.create(model="tiny-gemma3", messages=[{"role": "user", "content": "Tell me a story"}],
                                          max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    assert part.text == chat.choices[0].message.content
    # Every generated token's text is message text here: the same entries as chat's.
    assert [lp.model_dump() for lp in part.logprobs] == [lp.model_dump() for lp in chat.choices[0].logprobs.content]
    assert len(part.logprobs) == r.usage.output_tokens
    for lp in part.logprobs:
        assert len(lp.top_logprobs) == 3 and lp.bytes == list(lp.token.encode())
        assert lp.logprob == lp.top_logprobs[0].logprob  # greedy: the chosen token is the likeliest

    events = list(client.responses.create(**ask, include=LOGPROBS, top_logprobs=3, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [lp for e in deltas for lp in e.logprobs]
    expected = [{"token": lp.token, "logprob": lp.logprob,
                 "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in lp.top_logprobs]}
                for lp in part.logprobs]
    assert [lp.model_dump() for lp in streamed] == expected
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert [lp.model_dump() for lp in done.logprobs] == expected
    final_part = events[-1].response.output[0].content[0]
    assert final_part.logprobs == part.logprobs

    # include alone: the chosen tokens without alternatives.
    plain = client.responses.create(**ask, include=LOGPROBS)
    assert len(plain.output[0].content[0].logprobs) == len(part.logprobs)
    assert all(lp.top_logprobs == [] for lp in plain.output[0].content[0].logprobs)
    # top_logprobs without include returns none (as OpenAI does).
    none = client.responses.create(**ask, top_logprobs=5)
    assert none.output[0].content[0].logprobs == []
    assert all(e.logprobs == [] for e in client.responses.create(**ask, top_logprobs=5, stream=True)
               if e.type == "response.output_text.delta")


def test_logprobs_go_with_the_message_text_not_the_call(serve, monkeypatch):
    server = serve()
    tokenizer = server.engine.loaded.tokenizer
    text = 'Let me check.\n```tool_code\nget_weather(city="Paris", days=3)\n```'
    steer_to(monkeypatch, tokenizer.encode(text, add_special_tokens=False)
             + [tokenizer.convert_tokens_to_ids("<end_of_turn>")])
    ask = dict(model="tiny-gemma3", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=100,
               include=LOGPROBS, top_logprobs=2)
    r = serve().client().responses.create(**ask)
    message, call = r.output
    assert call.type == "function_call" and message.content[0].text == "Let me check."
    assert "".join(lp.token for lp in message.content[0].logprobs) == "Let me check."
    events = list(serve().client().responses.create(**ask, stream=True))
    streamed = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert "".join(streamed) == "Let me check."


def test_pending_logprobs_follow_the_text_that_comes_out():
    from vlm_serve.api.openai_responses import PendingLogprobs

    pending = PendingLogprobs()
    for text, name in [("Hi", "a"), ("", "b1"), ("é", "b2"), (" <marker>", "c"), (" there.\n", "d")]:
        pending.add(text, [{"token": name}])
    # The partial character's token goes with the character; a dropped marker's is dropped;
    # a token whose text comes out in two pieces is given with the first.
    assert [e["token"] for e in pending.take("Hié")] == ["a", "b1", "b2"]
    assert [e["token"] for e in pending.take(" there")] == ["d"]
    assert pending.take(".") == []  # the rest of "d": already given
    pending.clear()
    assert pending.take("x") == []


@pytest.mark.parametrize("body, param, code", [
    ({"include": "message.output_text.logprobs"}, "include", "invalid_type"),
    ({"include": [LOGPROBS[0], 3]}, "include", "invalid_type"),
    ({"include": [LOGPROBS[0], "message.output_text.tokens"]}, "include[1]", "invalid_value"),
    ({"include": LOGPROBS, "top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
    ({"top_logprobs": -1}, "top_logprobs", "integer_below_min_value"),
    ({"include": LOGPROBS, "top_logprobs": "3"}, "top_logprobs", "invalid_type"),
    ({"include": LOGPROBS, "top_logprobs": True}, "top_logprobs", "invalid_type"),
    ({"include": LOGPROBS, "top_logprobs": 2.5}, "top_logprobs", "invalid_type"),
])
def test_bad_logprobs_requests_are_openai_errors(serve, body, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        serve().client().responses.create(model="tiny-gemma3", input="hi", extra_body=body)
    error = info.value.body
    assert info.value.status_code == 400
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")
    assert error["message"]


def test_other_includables_are_accepted(serve):
    r = serve().client().responses.create(model="tiny-gemma3", input="hi", max_output_tokens=2,
                                          include=["reasoning.encrypted_content", "message.input_image.image_url"])
    assert r.output[0].content[0].logprobs == []


def test_json_schema_text_format(serve):
    r = serve().client().responses.create(
        model="tiny-gemma3", input="Describe a thing as JSON.", max_output_tokens=60, temperature=1.0,
        text={"format": {"type": "json_schema", "name": "thing", "schema": SCHEMA, "strict": True}},
        extra_body={"seed": 1})
    assert r.status == "completed"
    check(json.loads(r.output_text))
    assert r.text.format.type == "json_schema"


def test_failure_mid_stream_is_response_failed(serve):
    server = serve()
    fault = OneFault("decode")
    server.scheduler.fault_hook = fault
    try:
        with pytest.raises(openai.InternalServerError, match="injected fault"):
            server.client(max_retries=0).responses.create(model="tiny-gemma3", input="boom", max_output_tokens=20)
        fault.fired.clear()
        events = list(server.client().responses.create(model="tiny-gemma3", input="boom", max_output_tokens=20,
                                                       stream=True))
    finally:
        server.scheduler.fault_hook = None
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "failed" and "injected fault" in events[-1].response.error.message


def _errors():
    user = lambda content: [{"role": "user", "content": content}]  # noqa: E731
    bad_image = {"type": "input_image", "image_url": "data:image/png;base64,bm90IGFuIGltYWdl"}
    return [
        ({}, "input"),
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"input": ["hi"]}, "input[0]"),
        ({"input": [{"role": "user", "content": "hi"}, {"type": "file_search_call", "id": "x"}]}, "input[1].type"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": [{"role": "tool", "content": "hi"}]}, "input[0].role"),
        ({"input": user([{"type": "input_audio", "input_audio": {}}])}, "input[0].content[0].type"),
        ({"input": user([{"type": "input_image", "file_id": "file_1"}])}, "input[0].content[0].image_url"),
        ({"input": [{"role": "assistant", "content": [bad_image]}]}, "input[0].content[0]"),
        ({"input": user([{"type": "input_text", "text": "look"}, bad_image])}, "input[0].content[1].image_url"),
        ({"input": [{"type": "function_call_output", "output": "21"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]}, "input[0].arguments"),
        ({"input": "hi", "instructions": ["be brief"]}, "instructions"),
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": "nope"}}},
         "text.format.schema"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
        ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "hi", "model": "nope"}, "model"),
    ]


@pytest.mark.parametrize("body, param", _errors(), ids=lambda v: v if isinstance(v, str) else None)
def test_errors_name_the_responses_field(serve, body, param):
    r = httpx.post(serve().base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_openai_client_raises_bad_request_with_param(serve):
    with pytest.raises(openai.BadRequestError) as info:
        serve().client().responses.create(model="tiny-gemma3", input="hi", previous_response_id="resp_1")
    assert info.value.body["param"] == "previous_response_id"
    assert "keeps no state" in info.value.body["message"]
    # store is accepted and ignored.
    ok = serve().client().responses.create(model="tiny-gemma3", input="hi", max_output_tokens=2, store=True)
    assert ok.usage.output_tokens <= 2
