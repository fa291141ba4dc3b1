"""No request starves the others in preprocessing, and clients cannot run templates.

Real servers on loopback, real HTTP: a client's own chat template is refused unless the
operator trusts them; text that cannot fit the context is refused before tokenizing;
large prompts and slow image URLs never hold the threads small text requests need; a
request's images share one pixel budget.
"""

from __future__ import annotations

import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from conftest import data_url, make_image


def chat(server, messages, timeout=60, **extra):
    body = {"messages": messages, "max_tokens": 2, "temperature": 0, **extra}
    return httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=timeout)


def user(content):
    return [{"role": "user", "content": content}]


def test_client_chat_template_refused_unless_trusted(start_server):
    server = start_server("gemma3")
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    refused = chat(server, user("Hi"), chat_template_kwargs={"chat_template": template})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template_kwargs"
    # Keys the template does not read, or that belong to the server, change nothing.
    plain = chat(server, user("Hi")).json()["usage"]["prompt_tokens"]
    ignored = chat(server, user("Hi"), chat_template_kwargs={"tokenize": True, "add_generation_prompt": False,
                                                             "unused_variable": 1})
    assert ignored.status_code == 200 and ignored.json()["usage"]["prompt_tokens"] == plain

    trusting = start_server("gemma3", trust_request_chat_template=True)
    own = chat(trusting, user("Hi"), chat_template_kwargs={"chat_template": template})
    assert own.status_code == 200
    assert own.json()["usage"]["prompt_tokens"] < plain  # no turn markers: the client's template ran


def test_text_that_cannot_fit_is_refused_before_tokenizing(start_server):
    server = start_server("gemma3", max_model_len=64)
    ctx = server.app.state.vlm.prompt_context
    words = "lantern " * (ctx.max_prompt_bytes // 8 + 1)
    for response in (
        chat(server, user(words)),
        httpx.post(server.base_url + "/v1/completions", json={"prompt": words, "max_tokens": 1}, timeout=60),
    ):
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert "bytes" in error["message"]  # the size check, not the token count after tokenizing
    assert chat(server, user("Hi")).status_code == 200


def test_large_prompts_do_not_hold_up_small_requests(start_server):
    server = start_server("gemma3", cpu_workers=2)
    # ~1 MB: under the size that is refused unread, so it is tokenized in full (and
    # then refused for its token count: what is measured here is preprocessing alone).
    big = "The river ran past the mill and the heron watched. " * 20000
    assert len(big) < server.app.state.vlm.prompt_context.max_prompt_bytes
    finished: dict[str, float] = {}

    def send(name, text):
        response = chat(server, user(text), timeout=300)
        assert response.status_code == (200 if name == "small" else 400), response.text
        finished[name] = time.monotonic()

    with ThreadPoolExecutor(6) as pool:
        jobs = [pool.submit(send, f"big-{i}", big) for i in range(4)]
        time.sleep(0.2)  # the large prompts are being tokenized
        small = pool.submit(send, "small", "Hi!")
        for job in [*jobs, small]:
            job.result()
    # Each large prompt waits its turn in its own lane; the small one waits for none.
    assert finished["small"] < min(finished[f"big-{i}"] for i in range(4))


class SlowImages(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client that gave up is not an error here


@pytest.fixture
def slow_image_url():
    buf = io.BytesIO()
    make_image(32, 32).save(buf, "PNG")
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            release.wait(20)
            self.send_response(200)
            self.send_header("content-type", "image/png")
            self.send_header("content-length", str(len(buf.getvalue())))
            self.end_headers()
            self.wfile.write(buf.getvalue())

        def log_message(self, *args):
            pass

    httpd = SlowImages(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/slow.png", release
    release.set()
    httpd.shutdown()


def test_slow_image_urls_do_not_stall_text_requests(start_server, slow_image_url):
    url, release = slow_image_url
    server = start_server("gemma3", cpu_workers=2, allow_private_media_urls=True, media_fetch_timeout_s=30)
    image_turn = user([{"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": url}}])
    with ThreadPoolExecutor(8) as pool:
        waiting = [pool.submit(chat, server, image_turn) for _ in range(6)]
        time.sleep(0.3)  # every image request is now waiting on its URL
        text = chat(server, user("Hi!"), timeout=20)
        assert text.status_code == 200
        assert not any(job.done() for job in waiting)  # the text request did not wait for them
        release.set()
        assert all(job.result().status_code == 200 for job in waiting)


def test_images_of_one_request_share_a_pixel_budget(start_server):
    server = start_server("gemma3", max_pixels_per_request=10_000)
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(80, 80))}}  # 6,400 px
    one = chat(server, user([{"type": "text", "text": "One."}, image]))
    assert one.status_code == 200
    two = chat(server, user([{"type": "text", "text": "Two."}, image, image]))
    assert two.status_code == 400
    assert two.json()["error"]["code"] == "image_too_large"
    assert "in total" in two.json()["error"]["message"]
