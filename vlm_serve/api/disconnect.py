"""Running response work until the client goes away.

Whatever the ASGI server's spec version, a disconnect cancels the work at once, so the
request's row leaves the batch instead of generating for nobody.
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, TypeVar

from starlette.types import Receive

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
