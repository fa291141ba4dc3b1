"""Streaming responses: keep-alive comments during silences (and never after the end),
a disconnect that stops the stream and cancels its request, and the chunks of one event
written together yet read by the ``openai`` client as the same sequence of events."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from vlm_serve.api.event_stream import EventStreamResponse
from vlm_serve.api.generation import stream_sse
from vlm_serve.api.responses import SSE_DONE, SSE_HEARTBEAT, sse
from vlm_serve.engine.types import FinishReason, GenerationEvent

# -- the response on its own, over a recording ASGI send --------------------------------


class Client:
    """An ASGI peer that records what is sent and may disconnect at a given time."""

    def __init__(self, disconnect_after: float | None = None):
        self.sent: list[dict] = []
        self.disconnect_after = disconnect_after

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def receive(self) -> dict:
        if self.disconnect_after is None:
            await asyncio.Event().wait()  # never
        await asyncio.sleep(self.disconnect_after)
        return {"type": "http.disconnect"}

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def test_keep_alive_during_a_silence_and_none_after_the_end():
    async def body():
        yield b"data: 1\n\n"
        await asyncio.sleep(0.3)  # e.g. a long prefill
        yield b"data: 2\n\n"

    async def main():
        client = Client()
        await EventStreamResponse(body(), heartbeat_s=0.05)({}, client.receive, client.send)
        ended = list(client.bodies)
        await asyncio.sleep(0.15)  # the keep-alive timer is gone with the stream
        return ended, client.bodies

    ended, later = asyncio.run(main())
    assert later == ended
    assert ended[0] == b"data: 1\n\n" and ended[-2:] == [b"data: 2\n\n", b""]
    beats = ended[1:-2]
    assert 1 <= len(beats) <= 6 and set(beats) == {SSE_HEARTBEAT}  # ~5 (a busy box: fewer)


def test_no_keep_alive_while_chunks_flow():
    async def body():
        for i in range(20):
            await asyncio.sleep(0.01)
            yield f"data: {i}\n\n".encode()

    async def main():
        client = Client()
        await EventStreamResponse(body(), heartbeat_s=1.0)({}, client.receive, client.send)
        return client.bodies

    assert asyncio.run(main()) == [f"data: {i}\n\n".encode() for i in range(20)] + [b""]


def test_a_disconnect_during_a_silence_stops_the_stream_and_closes_its_body():
    closed, on_close = threading.Event(), threading.Event()

    async def body():
        try:
            yield b"data: 1\n\n"
            await asyncio.sleep(10)  # silent until the client goes away
            yield b"data: never\n\n"
        finally:
            closed.set()

    async def main():
        client = Client(disconnect_after=0.3)
        response = EventStreamResponse(body(), on_close=on_close.set, heartbeat_s=0.05)
        await asyncio.wait_for(response({}, client.receive, client.send), 2)
        ended = list(client.bodies)
        await asyncio.sleep(0.15)
        return ended, client.bodies

    ended, later = asyncio.run(main())
    assert closed.is_set() and on_close.is_set()
    assert later == ended  # nothing after the disconnect, keep-alives included
    assert ended[0] == b"data: 1\n\n" and b"data: never\n\n" not in ended
    assert SSE_HEARTBEAT in ended


# -- stream_sse: one write per event ----------------------------------------------------


def _events(n: int, error: bool = False):
    closed = []

    async def events():
        try:
            for i in range(n):
                last = i == n - 1
                yield GenerationEvent(
                    "r", text=f"t{i}", token_ids=[i],
                    finish_reason=(FinishReason.ERROR if error else FinishReason.LENGTH) if last else None,
                    error="boom" if error and last else None,
                )
        finally:
            closed.append(True)

    return events(), closed


def test_the_chunks_of_one_event_are_written_together_each_a_whole_sse_event():
    def chunks_for(event):  # like a chat's final event: content and its finish chunk
        return [sse({"text": event.text})] + ([sse({"text": ""}), sse({"n": 2})] if event.text == "t1" else [])

    def final_chunks(event):
        return [sse({"finish": event.finish_reason.value}), sse({"usage": 3})]

    async def collect(events):
        return [piece async for piece in stream_sse(events, chunks_for, final_chunks)]

    events, closed = _events(3)
    pieces = asyncio.run(collect(events))
    assert closed
    assert pieces == [
        sse({"text": "t0"}),
        sse({"text": "t1"}) + sse({"text": ""}) + sse({"n": 2}),
        sse({"text": "t2"}) + sse({"finish": "length"}) + sse({"usage": 3}),
        SSE_DONE,
    ]
    for piece in pieces:  # every write splits into whole events
        assert piece.endswith(b"\n\n")
        for event in piece[:-2].split(b"\n\n"):
            assert event.startswith(b"data: ")

    events, closed = _events(2, error=True)
    pieces = asyncio.run(collect(events))
    assert closed and pieces[-1].endswith(SSE_DONE) and b"boom" in pieces[-1]
    assert len(pieces) == 2


def test_an_event_with_no_chunks_writes_nothing():
    async def collect():
        events, _ = _events(3)
        return [p async for p in stream_sse(events, lambda e: [], lambda e: [], done=b"")]

    assert asyncio.run(collect()) == []


# -- over HTTP with the openai client ---------------------------------------------------


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("gemma3", max_num_seqs=4, prefix_cache_size=0)  # usage compares equal


class _Recording(httpx.BaseTransport):
    """An HTTP transport that keeps a copy of every response body's bytes as they are
    read, so a test sees the very stream the ``openai`` client parsed."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()
        self.received = bytearray()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        stream, received = response.stream, self.received

        class Tee(httpx.SyncByteStream):
            def __iter__(self):
                for part in stream:
                    received.extend(part)
                    yield part

            def close(self):
                stream.close()

        return httpx.Response(response.status_code, headers=response.headers, stream=Tee(),
                              extensions=response.extensions)


def _stream_both_ways(server, body: dict) -> tuple[list[dict], list, list[str]]:
    """One streamed request: the chunks the ``openai`` client read, and from the same
    bytes on the wire the data payloads in order and the comment lines."""
    recording = _Recording()
    client = server.client(http_client=httpx.Client(transport=recording, timeout=30))
    body = {k: v for k, v in body.items() if k != "stream"}
    stream = client.chat.completions.create(model="tiny-gemma3", stream=True, **body)
    chunks = [chunk.model_dump(exclude_unset=True) for chunk in stream]
    data, comments = [], []
    for line in recording.received.decode().splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            data.append(payload if payload == "[DONE]" else json.loads(payload))
        elif line.startswith(":"):
            comments.append(line)
    return chunks, data, comments


BODY = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 12,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


def _essence(chunk: dict) -> tuple:
    choices = [(c["index"], c["delta"].get("role"), c["delta"].get("content"), c["finish_reason"])
               for c in chunk["choices"]]
    return tuple(choices), json.dumps(chunk.get("usage"), sort_keys=True)


def _answer(chunks: list[dict]) -> tuple:
    """What a stream says, whatever its chunking (how many tokens share a chunk depends
    on timing): the text, the finish reasons and the usage."""
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    return text, finish, [c["usage"] for c in chunks if c.get("usage")]


def test_the_openai_client_reads_every_event_of_the_stream_in_order(server):
    chunks, raw, _ = _stream_both_ways(server, BODY)
    assert raw[-1] == "[DONE]"
    # The last write holds the last token, its finish chunk, the usage chunk and [DONE].
    assert [_essence(c) for c in chunks] == [_essence(c) for c in raw[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_keep_alives_in_a_silence_leave_the_events_the_clients_read_unchanged(server):
    expected, _, _ = _stream_both_ways(server, BODY)
    state = server.app.state.vlm
    slow_once = threading.Event()

    def hook(phase, states):
        if phase == "decode" and not slow_once.is_set():
            slow_once.set()
            threading.Event().wait(0.3)  # a silence between two tokens

    state.heartbeat_s = 0.05
    server.scheduler.fault_hook = hook
    try:
        chunks, raw, comments = _stream_both_ways(server, BODY)
    finally:
        server.scheduler.fault_hook = None
        state.heartbeat_s = 5.0
    assert comments and set(comments) == {": keep-alive"}
    # The client skips the comments and reads every event of the stream, in order ...
    assert [_essence(c) for c in chunks] == [_essence(c) for c in raw[:-1]]
    # ... and the answer is the one a stream without keep-alives gave.
    assert _answer(chunks) == _answer(expected)
