"""Running response work until the client goes away.

Whatever the ASGI server's spec version, a disconnect cancels the work at once, so the
request's row leaves the batch instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(work: Awaitable[T], receive: Receive) -> T | None:
    """Await ``work``; cancel it and return None if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task.result() if task.done() and not task.cancelled() else None


class EventStreamResponse:
    """``text/event-stream`` of the byte chunks of ``body``, stopped by a disconnect."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        headers: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
    ):
        self.body = body
        self.on_close = on_close  # runs however the stream ends, even before it started
        self.headers = {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        raw_headers += [(k.encode(), v.encode()) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": 200, "headers": raw_headers})

        async def pump() -> bool:
            async for chunk in self.body:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return True

        try:
            await unless_disconnected(pump(), receive)
        except OSError:
            pass  # the client went away mid-send
        finally:
            if self.on_close is not None:
                self.on_close()
