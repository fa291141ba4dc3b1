"""End to end over HTTP: the real server under Hypercorn on loopback, the official
``openai`` client for what users do, raw HTTP for malformed requests."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest

from conftest import OneFault, data_url, make_image, wait_until


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("gemma3", max_num_seqs=8, max_queue_size=4)


def image_message(text: str, *images) -> list[dict]:
    parts = [{"type": "text", "text": text}]
    parts += [{"type": "image_url", "image_url": {"url": data_url(im), "detail": None}} for im in images]
    return [{"role": "user", "content": parts}]


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model="tiny-gemma3", messages=messages, temperature=0, **kwargs)


def test_health_and_models(server):
    assert httpx.get(server.base_url + "/health").json()["status"] == "ok"
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny-gemma3"]
    raw = httpx.get(server.base_url + "/v1/models").json()
    assert raw["data"][0]["max_model_len"] > 0


def test_image_chat_non_streaming(server):
    client = server.client()
    r = chat(client, image_message("What is in this image?", make_image(40, 60)), max_tokens=8)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    # The image adds its image tokens to the prompt.
    text_only = chat(client, [{"role": "user", "content": "What is in this image?"}], max_tokens=1)
    assert r.usage.prompt_tokens > text_only.usage.prompt_tokens


def test_image_chat_streaming_with_usage_equals_non_streaming(server):
    client = server.client()
    messages = image_message("Describe it.", make_image(50, 30, 3))
    whole = chat(client, messages, max_tokens=10)
    chunks = list(chat(client, messages, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_ends_with_done(server):
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, "stream": True,
    }) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]"


@pytest.mark.parametrize(
    "body, param",
    [
        (b"{not json", None),
        (b'{"model": "tiny-gemma3"}', "messages"),
        (b'{"messages": []}', "messages"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [{"role": "wizard", "content": "x"}]}', "messages[0].role"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', "max_tokens"),
        (b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}', "temperature"),
        (b'{"messages": [{"role": "user", "content": "x"}], "model": "gpt-9"}', "model"),
        (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}',
         "messages[0].content[0].image_url"),
        (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000000}', "max_tokens"),
    ],
)
def test_bad_requests_get_400_envelope(server, body, param):
    r = httpx.post(server.base_url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param
    # ... and the server serves the next good request normally.
    ok = chat(server.client(), [{"role": "user", "content": "still there?"}], max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_sixteen_concurrent_image_requests_equal_sequential(start_server):
    server = start_server("gemma3", max_num_seqs=16)
    client = server.client()
    requests = [
        image_message(f"Request {i}: what do you see?", make_image(30 + 4 * i, 60 - 2 * i, i))
        if i % 4 else [{"role": "user", "content": f"Text request number {i}."}]
        for i in range(16)
    ]
    sequential = [chat(client, m, max_tokens=6 + i % 5).choices[0].message.content for i, m in enumerate(requests)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(chat, client, m, max_tokens=6 + i % 5) for i, m in enumerate(requests)]
        concurrent_ = [f.result().choices[0].message.content for f in futures]
    assert concurrent_ == sequential


def test_client_disconnect_cancels_row(server):
    body = {"messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 5000,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 5:
                break
    wait_until(lambda: not server.scheduler.running and server.engine.in_flight == 0)
    # Non-streaming too: a client that times out and goes away.
    body["stream"] = False
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=0.5)
    wait_until(lambda: not server.scheduler.running and server.engine.in_flight == 0)


def test_fault_in_decode_step_fails_its_rows_and_server_recovers(server):
    client = server.client(max_retries=0)  # the client would retry a 500 by default
    fault = OneFault("decode")
    server.scheduler.fault_hook = fault
    try:
        with pytest.raises(openai.InternalServerError) as info:
            chat(client, [{"role": "user", "content": "boom"}], max_tokens=20)
        assert "injected fault" in str(info.value)
        # Streaming: an error event, then [DONE].
        fault.fired.clear()
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "boom"}], "max_tokens": 20, "stream": True,
        }) as r:
            lines = [line for line in r.iter_lines() if line]
        assert any('"error"' in line and "injected fault" in line for line in lines)
        assert lines[-1] == "data: [DONE]"
    finally:
        server.scheduler.fault_hook = None
    ok = chat(client, image_message("fine again?", make_image(40, 40)), max_tokens=4)
    assert ok.usage.completion_tokens == 4


def test_queue_full_answers_503_with_retry_after(start_server):
    server = start_server("gemma3", max_num_seqs=1, max_queue_size=1)
    body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": 400, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = [pool.submit(httpx.post, server.base_url + "/v1/chat/completions", json=body, timeout=60)
                   for _ in range(2)]
        wait_until(lambda: server.engine.in_flight == 2)
        r = httpx.post(server.base_url + "/v1/chat/completions", json=body)
        assert r.status_code == 503
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "server_busy"
        assert all(f.result().status_code == 200 for f in running)


def test_fault_in_prefill_fails_only_that_request(server):
    client = server.client(max_retries=0)

    def fault(phase, states):
        if phase == "prefill" and any(s.request.num_images == 2 for s in states):
            raise RuntimeError("bad prefill")

    server.scheduler.fault_hook = fault
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bad = pool.submit(chat, client, image_message("two", make_image(30, 30), make_image(40, 40)), max_tokens=5)
            good = pool.submit(chat, client, image_message("one", make_image(30, 30)), max_tokens=5)
            with pytest.raises(openai.InternalServerError):
                bad.result()
            assert good.result().usage.completion_tokens == 5
    finally:
        server.scheduler.fault_hook = None


def test_request_timeout_stops_generation(start_server):
    server = start_server("gemma3", request_timeout_s=0.3)
    r = httpx.post(server.base_url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "forever"}], "max_tokens": 100000 // 1000 * 50,
        "ignore_eos": True,
    }, timeout=30)
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "timeout"
    assert server.engine.in_flight == 0


def test_failure_outside_any_step_fails_requests_and_engine_continues(server, monkeypatch):
    """A bug anywhere in the scheduler's turn still ends every request with an error."""
    from vlm_serve.engine import scheduler as scheduler_module

    calls = {"n": 0}
    original = scheduler_module.Scheduler._admit

    def broken_admit(self):
        if calls["n"] == 0 and self.waiting:
            calls["n"] += 1
            raise RuntimeError("admission bug")
        return original(self)

    monkeypatch.setattr(scheduler_module.Scheduler, "_admit", broken_admit)
    r = httpx.post(server.base_url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}, timeout=30)
    assert r.status_code == 500 and "admission bug" in r.json()["error"]["message"]
    ok = chat(server.client(), [{"role": "user", "content": "again"}], max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_health_answers_at_once_while_generating(server):
    body = {"messages": [{"role": "user", "content": "long one"}], "max_tokens": 300, "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(httpx.post, server.base_url + "/v1/chat/completions", json=body, timeout=60)
                   for _ in range(4)]
        wait_until(lambda: len(server.scheduler.running) >= 2)
        for _ in range(5):
            t = time.monotonic()
            assert httpx.get(server.base_url + "/health", timeout=5).json()["status"] == "ok"
            assert time.monotonic() - t < 0.5
        assert all(f.result().status_code == 200 for f in running)
