"""The HTTP side of a server-sent-event stream: its chunks written as they come, a
keep-alive comment during long silences, and a disconnect that stops it at once.

The keep-alive is a timer beside the stream, not a wait around each chunk: a chunk
costs one write and a clock read, and only a silence of ``heartbeat_s`` wakes the timer.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from starlette.types import Receive, Scope, Send

from .disconnect import unless_disconnected
from .responses import SSE_HEARTBEAT


class EventStreamResponse:
    """``text/event-stream`` of the byte chunks of ``body``, stopped by a disconnect.
    With ``heartbeat_s``, ``heartbeat`` is written whenever that long passes with
    nothing written (e.g. a long prefill), so proxies and clients see a live stream."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
        heartbeat_s: float | None = None,
        heartbeat: bytes = SSE_HEARTBEAT,
    ):
        self.body = body
        self.on_close = on_close  # runs however the stream ends, even before it started
        self.headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        self.heartbeat_s = heartbeat_s
        self.heartbeat = heartbeat

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        raw_headers += [(k.encode(), v.encode()) for k, v in self.headers.items()]
        try:
            await send({"type": "http.response.start", "status": 200, "headers": raw_headers})
            await unless_disconnected(_Writer(send, self.heartbeat_s, self.heartbeat).write_all(self.body),
                                      receive)
        except OSError:
            pass  # the client went away mid-send
        finally:
            if self.on_close is not None:
                self.on_close()
            aclose = getattr(self.body, "aclose", None)
            if aclose is not None:
                await aclose()  # the body's own cleanup now, not whenever it is collected


class _Writer:
    """Writes one stream's body; the keep-alive timer writes between its chunks, never
    inside one (both write under one lock) and never after the end."""

    def __init__(self, send: Send, heartbeat_s: float | None, heartbeat: bytes):
        self.send = send
        self.heartbeat_s = heartbeat_s
        self.heartbeat = heartbeat
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        self.last_write = self.loop.time()

    async def write(self, data: bytes) -> None:
        async with self.lock:
            await self.send({"type": "http.response.body", "body": data, "more_body": True})
        self.last_write = self.loop.time()

    async def write_all(self, body: AsyncIterator[bytes]) -> None:
        keep_alive = asyncio.ensure_future(self._keep_alive()) if self.heartbeat_s else None
        try:
            async for chunk in body:
                await self.write(chunk)
        finally:
            if keep_alive is not None:
                async with self.lock:  # a keep-alive being written goes out whole
                    keep_alive.cancel()
                await asyncio.gather(keep_alive, return_exceptions=True)
        await self.send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _keep_alive(self) -> None:
        while True:
            silent = self.loop.time() - self.last_write
            if silent >= self.heartbeat_s:
                await self.write(self.heartbeat)
            else:
                await asyncio.sleep(self.heartbeat_s - silent)
