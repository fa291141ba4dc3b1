"""``POST /v1/messages`` over real HTTP with the official ``anthropic`` client: the same
chat path as ``/v1/chat/completions``, in Anthropic's shapes, events and errors."""

from __future__ import annotations

import base64
import concurrent.futures
import io
import json

import anthropic
import httpx
import pytest

from conftest import OneFault, data_url, make_image, wait_until
from test_tool_calls import WEATHER_TOOL, _answer_ids, steer_to
from vlm_serve.engine import sampling

TOOL = {"name": "get_weather", "description": WEATHER_TOOL["function"]["description"],
        "input_schema": WEATHER_TOOL["function"]["parameters"]}
ASK = [{"role": "user", "content": "What's the weather in Paris for 3 days?"}]
# The anthropic SDK 2.x dropped temperature/top_p/top_k from its signature (Claude's newest
# models fix them); the API still takes them, so they go in the body.
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    media_dir = tmp_path_factory.mktemp("media")
    make_image(32, 32, 3).save(media_dir / "ok.png")
    srv = start_server("gemma3", allowed_local_media_path=str(media_dir))
    srv.media_dir = media_dir
    return srv


def client_of(server, **kwargs) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key=kwargs.pop("api_key", "none"), max_retries=0, **kwargs)


def sse_events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of every event of an Anthropic stream read raw."""
    out = []
    for block in response.text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if lines:
            out.append((lines["event"], json.loads(lines["data"])))
    return out


def png_base64(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_text_message_is_the_chat_completion_in_anthropic_shape(server):
    client = client_of(server)
    r = client.messages.create(model="tiny-gemma3", system="Be brief.", messages=[{"role": "user", "content": "Hi"}],
                               max_tokens=6, metadata={"user_id": "u1"}, extra_body=GREEDY)
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "tiny-gemma3"
    chat = server.client().chat.completions.create(
        model="tiny-gemma3", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=6, temperature=0)
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert r.stop_sequence is None
    # System as text blocks and content as blocks render the same prompt.
    again = client.messages.create(
        model="tiny-gemma3", system=[{"type": "text", "text": "Be brief."}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], max_tokens=6, extra_body=GREEDY)
    assert again.content == r.content and again.usage == r.usage


def test_streamed_equals_non_streamed_and_events_in_order(server):
    client = client_of(server)
    sampling = {"temperature": 0, "top_p": 0.9, "top_k": 40}
    args = dict(model="tiny-gemma3", messages=[{"role": "user", "content": "Tell me"}], max_tokens=8,
                extra_body=sampling)
    whole = client.messages.create(**args)
    with client.messages.stream(**args) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    # stream=True yields the typed events.
    kinds = [e.type for e in client.messages.create(**args, stream=True)]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    # Raw: named events, the ping after message_start, no OpenAI [DONE].
    raw = httpx.post(server.base_url + "/v1/messages", json={**args, **sampling, "stream": True}, timeout=30)
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in raw.text
    names = [name for name, _ in sse_events(raw)]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(name == data["type"] for name, data in sse_events(raw))


def test_image_blocks_base64_and_url(server):
    client = client_of(server)
    image = make_image(32, 32, 3)
    r = client.messages.create(model="tiny-gemma3", max_tokens=5, extra_body=GREEDY, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png_base64(image)}},
        {"type": "text", "text": "What is this?"}]}])
    chat = server.client().chat.completions.create(model="tiny-gemma3", max_tokens=5, temperature=0, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                     {"type": "text", "text": "What is this?"}]}])
    assert r.content[0].text == chat.choices[0].message.content
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    text_only = client.messages.create(model="tiny-gemma3", max_tokens=1, messages=[{"role": "user", "content": "What is this?"}])
    assert r.usage.input_tokens > text_only.usage.input_tokens  # the image tokens are in the prompt
    # A URL source goes through the same image loading (here a local file the server allows).
    by_url = client.messages.create(model="tiny-gemma3", max_tokens=5, extra_body=GREEDY, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": f"file://{server.media_dir / 'ok.png'}"}},
        {"type": "text", "text": "What is this?"}]}])
    assert by_url.content == r.content


def test_stop_sequences_and_max_tokens(server, monkeypatch):
    steer_to(monkeypatch, _answer_ids(server, "Hello world. Bye", "<end_of_turn>"))
    client = client_of(server)
    args = dict(model="tiny-gemma3", messages=[{"role": "user", "content": "Greet"}], max_tokens=50)
    r = client.messages.create(**args, stop_sequences=["Bye", "world"])
    assert r.content[0].text == "Hello " and r.stop_reason == "stop_sequence" and r.stop_sequence == "world"
    with client.messages.stream(**args, stop_sequences=["world"]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "world"
    done = client.messages.create(**args)
    assert done.content[0].text == "Hello world. Bye" and done.stop_reason == "end_turn" and done.stop_sequence is None
    cut = client.messages.create(**{**args, "max_tokens": 2})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


@pytest.mark.parametrize("arch, text, end", [
    ("gemma3", 'Let me check.\n```tool_code\nget_weather(city="Paris", days=3)\n```', "<end_of_turn>"),
    ("qwen2_5_vl", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
                   "</tool_call>", "<|im_end|>"),
])
def test_tool_use_streamed_and_not(arch, text, end, start_server, monkeypatch):
    server = start_server(arch)
    steer_to(monkeypatch, _answer_ids(server, text, end))
    client = client_of(server)
    model = f"tiny-{arch}"
    r = client.messages.create(model=model, messages=ASK, tools=[TOOL], max_tokens=200)
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["text", "tool_use"]
    assert r.content[0].text == "Let me check."
    call = r.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris", "days": 3} and call.id

    with client.messages.stream(model=model, messages=ASK, tools=[TOOL], max_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "input", None)) for b in final.content] == [("text", None), ("tool_use", call.input)]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.partial_json for d in deltas if d.type == "input_json_delta") == json.dumps(call.input)

    # tool_choice: "any" and a named tool keep the tool; "none" hides it (plain text, no parse).
    # "any" and a named tool are enforced by a grammar: the reply must be the call alone.
    steer_to(monkeypatch, _answer_ids(server, text[text.index("```" if arch == "gemma3" else "<tool_call>"):], end))
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}, {"type": "auto"}):
        assert client.messages.create(model=model, messages=ASK, tools=[TOOL], tool_choice=choice,
                                      max_tokens=200).stop_reason == "tool_use"
    plain = client.messages.create(model=model, messages=ASK, tools=[TOOL], tool_choice={"type": "none"}, max_tokens=200)
    assert plain.stop_reason == "end_turn" and [b.type for b in plain.content] == ["text"]

    # The tool_use goes back in the assistant turn, its result in the next user turn.
    followup = ASK + [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                          {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": '{"temp_c": 21}'}]},
            {"type": "text", "text": "And tomorrow?"}]},
    ]
    again = client.messages.create(model=model, messages=followup, tools=[TOOL], max_tokens=200)
    assert again.stop_reason == "tool_use" and again.usage.input_tokens > r.usage.input_tokens
    string_result = followup[:-1] + [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": '{"temp_c": 21}'}]}]
    assert client.messages.create(model=model, messages=string_result, tools=[TOOL], max_tokens=200).content


def test_gemma4_thinking_block(start_server, monkeypatch):
    from test_reasoning import TEXT

    server = start_server("gemma4")
    steer_to(monkeypatch, _answer_ids(server, TEXT, "<turn|>"))
    client = client_of(server)
    args = dict(model="tiny-gemma4", messages=[{"role": "user", "content": "hi"}], max_tokens=100,
                thinking={"type": "enabled", "budget_tokens": 1024})
    r = client.messages.create(**args)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "The user greets me; answer kindly." and r.content[1].text == "Hello there!"
    with client.messages.stream(**args) as stream:
        final = stream.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content] == [
        ("thinking", r.content[0].thinking), ("text", "Hello there!")]
    # Earlier thinking blocks may come back in the history (they are not replayed).
    history = args["messages"] + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                                  {"role": "user", "content": "again"}]
    assert client.messages.create(**{**args, "messages": history}).content[1].text == "Hello there!"


@pytest.mark.parametrize("body, needle", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
     "source"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "bm90IGFuIGltYWdl"}}]}]},
     "image"),
    ({"max_tokens": 5, "temperature": 3, "messages": [{"role": "user", "content": "x"}]}, "temperature"),
    ({"max_tokens": 5, "stop_sequences": "x", "messages": [{"role": "user", "content": "x"}]}, "stop_sequences"),
    ({"max_tokens": 5, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL],
      "messages": [{"role": "user", "content": "x"}]}, "nope"),
])
def test_invalid_requests_get_anthropic_errors(server, body, needle):
    with pytest.raises(anthropic.BadRequestError) as info:
        client_of(server).post("/v1/messages", cast_to=object, body=body)
    err = info.value
    assert err.status_code == 400
    assert err.body["type"] == "error" and err.body["error"]["type"] == "invalid_request_error"
    assert needle in err.body["error"]["message"]


def test_method_and_body_errors_in_anthropic_shape(server):
    r = httpx.get(server.base_url + "/v1/messages")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.base_url + "/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_generation_failure_is_an_error_event_mid_stream(server, monkeypatch):
    original = sampling.BatchSampler.sample

    def broken(self, logits, allowed=None):
        monkeypatch.setattr(sampling.BatchSampler, "sample", original)  # fail once only
        raise RuntimeError("sampler exploded")

    monkeypatch.setattr(sampling.BatchSampler, "sample", broken)
    raw = httpx.post(server.base_url + "/v1/messages", timeout=30, json={
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "stream": True})
    events = sse_events(raw)
    assert events[0][0] == "message_start"
    name, data = events[-1]
    assert name == "error" and data["type"] == "error" and data["error"]["type"] == "api_error"
    assert "sampler exploded" in data["error"]["message"]
    # The engine continues.
    assert client_of(server).messages.create(max_tokens=2, model="tiny-gemma3",
                                             messages=[{"role": "user", "content": "x"}]).usage.output_tokens >= 1


def test_api_key_as_x_api_key_or_bearer(start_server):
    server = start_server("gemma3", api_key="sekrit")
    ask = dict(model="tiny-gemma3", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.AuthenticationError) as info:
        client_of(server, api_key="wrong").messages.create(**ask)
    assert info.value.body["error"]["type"] == "authentication_error"
    assert client_of(server, api_key="sekrit").messages.create(**ask).type == "message"  # x-api-key
    bearer = httpx.post(server.base_url + "/v1/messages", json=ask, headers={"Authorization": "Bearer sekrit"}, timeout=30)
    assert bearer.status_code == 200
    # The OpenAI routes take x-api-key too, and keep their own error shape.
    r = httpx.post(server.base_url + "/v1/chat/completions", json=ask, headers={"x-api-key": "sekrit"}, timeout=30)
    assert r.status_code == 200
    assert httpx.get(server.base_url + "/v1/models").json()["error"]["code"] == "invalid_api_key"


def anthropic_error(info) -> tuple[int, str]:
    err = info.value
    assert err.body["type"] == "error" and set(err.body["error"]) == {"type", "message"} and err.body["error"]["message"]
    return err.status_code, err.body["error"]["type"]


def test_full_queue_is_529_overloaded(start_server):
    """A full queue is OpenAI's 503 + Retry-After on the chat route and Anthropic's 529
    overloaded_error (with Retry-After) here, streamed or not; nothing is mocked: the
    server's own queue is filled."""
    server = start_server("gemma3", max_num_seqs=1, max_queue_size=1)
    long = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 400, "ignore_eos": True}
    client = client_of(server)
    ask = dict(model="tiny-gemma3", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(httpx.post, server.base_url + "/v1/chat/completions", json=long, timeout=120)
                   for _ in range(2)]
        wait_until(lambda: server.engine.in_flight == 2, timeout=30)
        with pytest.raises(anthropic.OverloadedError) as info:
            client.messages.create(**ask)
        assert anthropic_error(info) == (529, "overloaded_error")
        assert info.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.OverloadedError):
            client.messages.create(**ask, stream=True)
        with pytest.raises(anthropic.OverloadedError):
            with client.messages.stream(**ask) as stream:
                list(stream)
        # The OpenAI route keeps OpenAI's 503 at the same moment.
        chat = httpx.post(server.base_url + "/v1/chat/completions", json=long, timeout=30)
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "server_busy"
        assert all(f.result().status_code == 200 for f in running)
    assert client.messages.create(**ask).type == "message"  # and it serves again
    # Shutting down (after SIGTERM, see test_lifecycle.py) refuses new requests the same way.
    server.engine.draining = True
    try:
        with pytest.raises(anthropic.OverloadedError) as info:
            client.messages.create(**ask)
        assert anthropic_error(info) == (529, "overloaded_error")
    finally:
        server.engine.draining = False


def test_error_statuses_and_types_are_anthropics(start_server):
    server = start_server("gemma3", max_request_bytes=4096)
    client = client_of(server)
    ask = dict(model="tiny-gemma3", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    # 404: a model not served here, a route not served here.
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.create(**{**ask, "model": "claude-opus-9"})
    assert anthropic_error(info) == (404, "not_found_error") and "claude-opus-9" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as info:
        client.messages.count_tokens(model="tiny-gemma3", messages=ask["messages"])
    assert anthropic_error(info) == (404, "not_found_error")
    # 413: a body over --max-request-bytes.
    with pytest.raises(anthropic.ContentTooLargeError) as info:
        client.messages.create(**{**ask, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert anthropic_error(info) == (413, "request_too_large")
    # 500: generation fails; streamed, an `error` event the SDK raises from.
    fault = OneFault("decode")
    server.scheduler.fault_hook = fault
    try:
        with pytest.raises(anthropic.InternalServerError) as info:
            client.messages.create(**ask)
        assert anthropic_error(info) == (500, "api_error") and "injected fault" in info.value.body["error"]["message"]
        fault.fired.clear()
        with pytest.raises(anthropic.APIStatusError) as info:
            list(client.messages.create(**ask, stream=True))
        assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "api_error"
        assert "injected fault" in info.value.body["error"]["message"]
    finally:
        server.scheduler.fault_hook = None
    # OpenAI's routes keep OpenAI's envelope.
    r = httpx.post(server.base_url + "/v1/chat/completions", json={**ask, "model": "claude-opus-9"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"


def test_request_timeout_is_504_timeout_error(start_server):
    server = start_server("gemma3", request_timeout_s=0.3)
    with pytest.raises(anthropic.APIStatusError) as info:
        client_of(server).messages.create(model="tiny-gemma3", max_tokens=3000, extra_body={"temperature": 0},
                                          messages=[{"role": "user", "content": "Tell me"}])
    assert anthropic_error(info) == (504, "timeout_error")
