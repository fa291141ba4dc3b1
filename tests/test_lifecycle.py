"""The server's life as a real process: a graceful stop, fast failing starts, the access
log, the request-smuggling guard. Each test runs ``python -m vlm_serve.cli`` (the tiny
demo model, from the fixture cache) and talks real HTTP to it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import free_port
from vlm_serve.cli import build_parser
from vlm_serve.config import ServerConfig

CHAT = "/v1/chat/completions"


class Server:
    """``vlm-serve`` in a subprocess; its stdout and stderr go to one log file."""

    def __init__(self, log_path, *args: str):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vlm_serve.cli", "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=os.environ.copy(),
        )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.05)
        raise AssertionError("server did not start:\n" + self.output())

    def in_flight(self) -> int:
        return httpx.get(self.base + "/health", timeout=5).json()["in_flight"]

    def stop(self, sig=signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def output(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def start(tmp_path):
    servers: list[Server] = []

    def start_(*args: str) -> Server:
        server = Server(tmp_path / f"server{len(servers)}.log", *args)
        servers.append(server)
        server.wait_ready()
        return server

    yield start_
    for server in servers:
        server.kill()


def assert_clean_exit(server: Server, rc: int) -> str:
    out = server.output()
    assert rc == 0, out
    assert "Traceback" not in out and "terminate called" not in out, out
    return out


def body(max_tokens: int, stream: bool) -> dict:
    return {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens, "ignore_eos": True, "stream": stream,
    }


class StreamReader(threading.Thread):
    """Reads one SSE stream to its end; ``started`` is set at the first content chunk."""

    def __init__(self, base: str, max_tokens: int):
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.started = threading.Event()
        self.events: list[str] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base + CHAT, json=body(self.max_tokens, True), timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        if '"content"' in line and '"content": ""' not in line:
                            self.started.set()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        self.started.set()

    def outcome(self) -> str:
        """'finished' or 'error'; fails unless the stream ended with [DONE] right after."""
        assert self.error is None, self.error
        assert self.events[-1] == "[DONE]", self.events[-3:]
        last = json.loads(self.events[-2])
        if "error" in last:
            assert last["error"]["message"]
            return "error"
        assert last["choices"][0]["finish_reason"] in ("length", "stop"), last
        return "finished"


def test_sigterm_mid_generation_ends_every_request_cleanly(start):
    server = start("--shutdown-timeout", "2")
    long_streams = [StreamReader(server.base, 20000) for _ in range(3)]
    for s in long_streams:
        s.start()
    plain: dict = {}

    def non_streaming() -> None:
        r = httpx.post(server.base + CHAT, json=body(20000, False), timeout=60)
        plain.update(status=r.status_code, body=r.json())

    plain_thread = threading.Thread(target=non_streaming, daemon=True)
    plain_thread.start()
    for s in long_streams:
        assert s.started.wait(30)
    deadline = time.monotonic() + 30
    while server.in_flight() < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    short = StreamReader(server.base, 20)  # finishes well within the grace period
    short.start()
    assert short.started.wait(30)

    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # After the signal a new request is refused: no listener, or a 503 envelope.
    try:
        late = httpx.post(server.base + CHAT, json=body(5, False), timeout=5)
        assert late.status_code == 503 and late.json()["error"]["message"], late.text
    except httpx.ConnectError:
        pass

    out = assert_clean_exit(server, server.stop(timeout=30))
    for s in (*long_streams, short):
        s.join(10)
    assert short.outcome() == "finished"
    assert [s.outcome() for s in long_streams] == ["error"] * 3
    plain_thread.join(10)
    assert plain["status"] == 503, plain
    assert plain["body"]["error"]["message"] == "the server is shutting down"
    # Streams are logged when they end, with their request id and token counts.
    assert out.count('"POST /v1/chat/completions" 200') == 4, out
    assert '"POST /v1/chat/completions" 503' in out
    assert "id=chatcmpl-" in out and "completion_tokens=20" in out


def test_access_log_and_smuggling_guard(start):
    server = start()
    r = httpx.post(server.base + CHAT, content=b"{not json", timeout=5)
    assert r.status_code == 400

    # Content-Length with Transfer-Encoding: 400, then the connection is closed, so the
    # request hidden behind it is never answered.
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
        conn.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower()
    assert reply.count(b"HTTP/1.1") == 1

    out = assert_clean_exit(server, server.stop(signal.SIGINT))
    access = [line for line in out.splitlines() if "vlm_serve.access" in line]
    assert any('"POST /v1/chat/completions" 400' in line and "id=-" in line for line in access), out
    assert sum(" 400 " in line for line in access) == 2, access


def test_busy_port_fails_fast_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = subprocess.run(
            [sys.executable, "-m", "vlm_serve.cli", "--port", str(port), "--model", "/"],
            capture_output=True, text=True, timeout=60,
        )
    assert p.returncode != 0
    assert p.stderr.strip().splitlines() == [
        f"vlm-serve: error: cannot bind 127.0.0.1:{port}: Address already in use"
    ], p.stderr


@pytest.mark.parametrize("model", ["/no/such/model", "./missing-model"])
def test_missing_model_path_fails_fast_in_one_line(model):
    p = subprocess.run(
        [sys.executable, "-m", "vlm_serve.cli", "--port", str(free_port()), "--model", model],
        capture_output=True, text=True, timeout=60,
    )
    assert p.returncode != 0
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"vlm-serve: error: --model {model}:"), p.stderr


def test_lifecycle_flags_reach_the_config():
    args = build_parser().parse_args([
        "--shutdown-timeout", "5", "--no-access-log", "--trust-request-chat-template",
        "--max-pixels-per-request", "1000",
    ])
    config = ServerConfig(**vars(args))
    assert config.shutdown_timeout_s == 5 and config.access_log is False
    assert config.trust_request_chat_template is True and config.max_pixels_per_request == 1000
    defaults = ServerConfig(**vars(build_parser().parse_args([])))
    assert defaults.access_log and not defaults.trust_request_chat_template
    assert defaults.max_pixels_per_request == 100_000_000
