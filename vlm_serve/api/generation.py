"""What chat and text completions share: starting a generation, waiting for its end,
and streaming it as server-sent events (with heartbeats, see event_stream) and in-band
errors."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from ..engine.types import FinishReason, GenerationEvent, PreparedRequest, TokenLogprob
from .disconnect import unless_disconnected
from .errors import APIError
from .event_stream import EventStreamResponse
from .responses import SSE_DONE, sse
from .state import AppState

log = logging.getLogger("vlm_serve.api")


def start(state: AppState, prepared: PreparedRequest) -> AsyncIterator[GenerationEvent]:
    """Submit to the engine; the events come back with metrics recorded."""
    arrived = time.monotonic()
    return state.metrics.observe(state.submit(prepared), arrived)


async def deliver(
    state: AppState,
    request: Request,
    request_id: str | list[str],
    stream: AsyncIterator[bytes] | None,
    respond: Callable[[], Awaitable[Response]],
) -> Response:
    """The response of a submitted request: ``stream`` as server-sent events, or the
    awaited ``respond()``. Either way a client that leaves cancels the request, even one
    that leaves before the response starts reading events (cancelling a finished
    request is a no-op). Several ids: the requests of a response's several choices."""
    ids = [request_id] if isinstance(request_id, str) else request_id

    def cancel() -> None:
        for id_ in ids:
            state.engine.cancel(id_)

    if stream is not None:
        return EventStreamResponse(stream, on_close=cancel, heartbeat_s=state.heartbeat_s)
    result = await unless_disconnected(respond(), request.receive)
    if result is None:
        cancel()
        return Response(status_code=499)
    return result


def error_of(event: GenerationEvent) -> APIError | None:
    if event.finish_reason == FinishReason.ERROR:
        return APIError(500, event.error or "generation failed", code="generation_error")
    if event.finish_reason == FinishReason.TIMEOUT:
        return APIError(504, event.error or "request timed out", code="timeout")
    if event.finish_reason == FinishReason.CANCELLED:
        return APIError(503, event.error or "request was cancelled", code="cancelled")
    return None


@dataclass
class Finished:
    text: str
    final: GenerationEvent
    logprobs: list[TokenLogprob] = field(default_factory=list)


async def run_to_end(events: AsyncIterator[GenerationEvent]) -> Finished:
    text, logprobs, final = [], [], None
    async for event in events:
        error = error_of(event)
        if error is not None:
            raise error
        text.append(event.text)
        logprobs += event.logprobs
        final = event
    return Finished("".join(text), final, logprobs)


async def stream_sse(
    events: AsyncIterator[GenerationEvent],
    chunks_for: Callable[[GenerationEvent], list[bytes]],
    final_chunks: Callable[[GenerationEvent], list[bytes]],
    error_chunk: Callable[[APIError], bytes] = lambda error: sse(error.body()),
    done: bytes = SSE_DONE,
) -> AsyncIterator[bytes]:
    """SSE bytes: per-event chunks, the closing chunks, then ``done``. A failure is
    ``error_chunk`` (OpenAI's envelope unless a protocol has its own) followed by ``done``.
    The chunks of one event come as one piece (one write: a write costs far more than
    its bytes), each chunk a whole SSE event; an event with no chunks writes nothing."""
    try:
        async for event in events:
            error = error_of(event)
            if error is not None:
                yield error_chunk(error) + done
                return
            try:
                chunks = chunks_for(event) + (final_chunks(event) if event.finished else [])
            except Exception:  # a bug of ours: end the stream in-band, not with a torn connection
                log.exception("could not build a stream chunk")
                yield error_chunk(APIError(500, "internal server error", code="internal_error")) + done
                return
            if chunks:
                yield b"".join(chunks)
        if done:
            yield done
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()  # ends the request's stream now (an early end cancels it)
