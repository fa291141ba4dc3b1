"""The OpenAI-compatible surface: completions, logprobs, metrics, auth, the error battery."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import data_url, make_image


@pytest.fixture(scope="module")
def server(start_server, tmp_path_factory):
    media_dir = tmp_path_factory.mktemp("media")
    make_image(32, 32).save(media_dir / "ok.png")
    srv = start_server("gemma3", max_request_bytes=200_000, limit_mm_per_prompt=2,
                       allowed_local_media_path=str(media_dir), media_fetch_timeout_s=1.0)
    srv.media_dir = media_dir
    return srv


def post(server, path, body=None, **kwargs):
    return httpx.post(server.base_url + path, json=body, timeout=30, **kwargs)


def user(content):
    return [{"role": "user", "content": content}]


def test_text_completions(server):
    client = server.client()
    r = client.completions.create(model="tiny-gemma3", prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    streamed = client.completions.create(model="tiny-gemma3", prompt="Once upon a time", max_tokens=6,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    with_lp = client.completions.create(model="tiny-gemma3", prompt="Once", max_tokens=3, temperature=0, logprobs=2)
    lp = with_lp.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(len(t) == 2 for t in lp.top_logprobs)


def test_chat_logprobs_in_openai_shape(server):
    client = server.client()
    r = client.chat.completions.create(model="tiny-gemma3", messages=user("hi"), max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-5)
    chunks = list(client.chat.completions.create(model="tiny-gemma3", messages=user("hi"), max_tokens=4,
                                                 temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_max_completion_tokens_and_developer_role_and_multi_turn_images(server):
    client = server.client()
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "first"},
                                     {"type": "image_url", "image_url": {"url": data_url(make_image(30, 30, 1))}}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(make_image(40, 20, 2), "JPEG")}},
                                     {"type": "text", "text": "and this?"}]},
    ]
    r = client.chat.completions.create(model="tiny-gemma3", messages=messages, max_completion_tokens=3,
                                       temperature=0, user="someone", extra_body={"some_unknown_field": 1})
    assert r.usage.completion_tokens == 3


def test_local_file_image_under_allowed_path(server):
    r = post(server, "/v1/chat/completions", {"messages": user([
        {"type": "image_url", "image_url": {"url": f"file://{server.media_dir / 'ok.png'}"}}]), "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_metrics_scraped_by_prometheus_parser(server):
    server.client().chat.completions.create(model="tiny-gemma3", messages=user("count me"), max_tokens=3)
    text = httpx.get(server.base_url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("vlm_requests", "vllm:prompt_tokens", "vllm:generation_tokens",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:num_requests_running",
                 "vllm:num_requests_waiting", "vlm_kv_cache_bytes"):
        assert name in families, name
    finished = [s for s in families["vlm_requests"].samples if s.labels.get("outcome") == "length"]
    assert finished and finished[0].value >= 1
    generated = [s for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total")]
    assert generated[0].value >= 3


def test_heartbeats_during_slow_prefill(server):
    state = server.app.state.vlm
    state.heartbeat_s = 0.05
    server.scheduler.fault_hook = lambda phase, states: time.sleep(0.1) if phase == "prefill" else None
    try:
        with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={
            "messages": user("slow"), "max_tokens": 2, "stream": True}) as r:
            lines = [line for line in r.iter_lines() if line]
    finally:
        server.scheduler.fault_hook = None
        state.heartbeat_s = 5.0
    assert ": keep-alive" in lines
    assert lines[-1] == "data: [DONE]"


BIG_PIXELS = make_image(64, 64)


def _battery(server):
    ok_image = {"type": "image_url", "image_url": {"url": data_url(make_image(20, 20))}}
    url_part = lambda url: {"type": "image_url", "image_url": {"url": url}}  # noqa: E731
    gif = data_url(make_image(20, 20), "GIF")
    return [
        # (description, method, path, body or raw bytes, headers, status, param)
        ("malformed json", "POST", "/v1/chat/completions", b"{oops", {}, 400, None),
        ("wrong type", "POST", "/v1/chat/completions", {"messages": user("x"), "temperature": "hot"}, {}, 400, "temperature"),
        ("missing messages", "POST", "/v1/chat/completions", {"model": "tiny-gemma3"}, {}, 400, "messages"),
        ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, {}, 400, "messages"),
        ("unknown model", "POST", "/v1/chat/completions", {"messages": user("x"), "model": "nope"}, {}, 400, "model"),
        ("n over 16", "POST", "/v1/chat/completions", {"messages": user("x"), "n": 17}, {}, 400, "n"),
        ("unknown response format", "POST", "/v1/chat/completions", {"messages": user("x"), "response_format": {"type": "xml"}}, {}, 400, "response_format.type"),
        ("schema not an object", "POST", "/v1/chat/completions", {"messages": user("x"), "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "nope"}}}, {}, 400, "response_format.json_schema"),
        ("undecodable image", "POST", "/v1/chat/completions", {"messages": user([url_part("data:image/png;base64,bm90IGFuIGltYWdl")])}, {}, 400, "messages[0].content[0].image_url"),
        ("unsupported scheme", "POST", "/v1/chat/completions", {"messages": user([url_part("ftp://example.com/a.png")])}, {}, 400, "messages[0].content[0].image_url"),
        ("image too many pixels", "POST", "/v1/chat/completions", None, {}, 400, None),
        ("too many images", "POST", "/v1/chat/completions", {"messages": user([ok_image] * 3)}, {}, 400, "messages"),
        ("prompt over context", "POST", "/v1/chat/completions", {"messages": user("x"), "max_tokens": 10**9}, {}, 400, "max_tokens"),
        ("private url", "POST", "/v1/chat/completions", {"messages": user([url_part("http://127.0.0.1:9/a.png")])}, {}, 400, "messages[0].content[0].image_url"),
        ("file outside allowed path", "POST", "/v1/chat/completions", {"messages": user([url_part("file:///etc/passwd")])}, {}, 400, "messages[0].content[0].image_url"),
        ("unreachable url", "POST", "/v1/chat/completions", {"messages": user([url_part("http://unreachable.invalid/a.png")])}, {}, 400, "messages[0].content[0].image_url"),
        ("gif is fine", "POST", "/v1/chat/completions", {"messages": user([url_part(gif)]), "max_tokens": 1}, {}, 200, None),
        ("unknown route", "GET", "/v1/nothing", None, {}, 404, None),
        ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, None),
        ("body too large", "POST", "/v1/chat/completions", {"messages": user("x" * 300_000)}, {}, 413, None),
        ("completions without prompt", "POST", "/v1/completions", {"max_tokens": 2}, {}, 400, "prompt"),
    ]


def test_error_battery_then_good_request(server):
    state = server.app.state.vlm
    # Pixels over the limit: shrink the limit for this one request's sake.
    for name, method, path, body, headers, status, param in _battery(server):
        if name == "image too many pixels":
            original = state.prompt_context.media
            from dataclasses import replace

            state.prompt_context.media = replace(original, max_image_pixels=100)
            body = {"messages": user([{"type": "image_url", "image_url": {"url": data_url(BIG_PIXELS)}}])}
            param = "messages[0].content[0].image_url"
        try:
            kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
            r = httpx.request(method, server.base_url + path, timeout=30, headers=headers, **kwargs)
        finally:
            if name == "image too many pixels":
                state.prompt_context.media = original
        assert r.status_code == status, f"{name}: {r.status_code} {r.text}"
        if status >= 400:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert error["message"] and "Traceback" not in error["message"], name
            if param is not None:
                assert error["param"] == param, f"{name}: {error}"
        good = server.client().chat.completions.create(model="tiny-gemma3", messages=user("good"), max_tokens=2)
        assert good.usage.completion_tokens == 2, name


def test_api_key_required_when_set(start_server):
    server = start_server("gemma3", api_key="sekrit")
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong", max_retries=0).models.list()
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"messages": user("x")})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.base_url + "/health").status_code == 200
    ok = server.client(api_key="sekrit").chat.completions.create(model="tiny-gemma3", messages=user("x"), max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_usage_reports_prompt_tokens_served_from_the_prefix_cache(server):
    client = server.client()
    history = [{"role": "user", "content": "Tell me about rivers and the sea, at some length please."}]
    first = client.chat.completions.create(model="tiny-gemma3", messages=history, max_tokens=3, temperature=0)
    again = client.chat.completions.create(model="tiny-gemma3", messages=history, max_tokens=3, temperature=0)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in (first, again)]
    # Earlier requests of this module share the template's opening tokens, so reuse
    # shows; at least one token is always prefilled to give the first logits.
    assert max(cached) > 0
    assert all(0 <= c <= first.usage.prompt_tokens - 1 for c in cached)
    assert again.choices[0].message.content == first.choices[0].message.content
