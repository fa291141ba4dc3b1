"""``POST /v1/chat/completions``: validate, prepare on the CPU pool, generate, respond."""

from __future__ import annotations

import time
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.engine import EngineBusy, RequestStream
from ..engine.types import FinishReason, GenerationEvent, PreparedRequest
from ..preprocess.prompt import prepare_chat
from .disconnect import EventStreamResponse, unless_disconnected
from .errors import APIError
from .output import OutputProcessor, merge_deltas
from .responses import SSE_DONE, ChunkWriter, finish_reason, logprob_content, new_id, usage
from .schemas import parse_chat_request
from .state import AppState, read_json


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    chat = parse_chat_request(body, state.loaded.vocab_size)
    state.check_model(chat.model)
    completion_id = new_id("chatcmpl")
    prepared = await state.run_cpu(
        prepare_chat, state.prompt_context, completion_id, chat.messages, chat.sampling,
        chat.tools, chat.chat_template_kwargs,
    )
    state.apply_limits(prepared, chat.max_tokens)
    stream = state.submit(prepared)
    output = OutputProcessor()
    if chat.stream:
        writer = ChunkWriter(completion_id, state.model_id)
        return EventStreamResponse(_stream_chunks(state, stream, output, writer, chat.include_usage))
    result = await unless_disconnected(_collect(state, stream, output, completion_id), request.receive)
    return result if result is not None else Response(status_code=499)


def raise_for_error(event: GenerationEvent) -> None:
    if event.finish_reason == FinishReason.ERROR:
        raise APIError(500, event.error or "generation failed", code="generation_error")
    if event.finish_reason == FinishReason.TIMEOUT:
        raise APIError(504, event.error or "request timed out", code="timeout")
    if event.finish_reason == FinishReason.CANCELLED:
        raise APIError(503, event.error or "request was cancelled", code="cancelled")


async def _collect(state: AppState, stream: RequestStream, output: OutputProcessor, completion_id: str):
    deltas: list[dict] = []
    logprobs = []
    final = None
    async for event in stream:
        raise_for_error(event)
        deltas += output.feed(event.text)
        logprobs += event.logprobs
        final = event
    deltas += output.finish()
    choice = {
        "index": 0,
        "message": merge_deltas(deltas),
        "logprobs": {"content": logprob_content(logprobs, state.token_text)} if logprobs else None,
        "finish_reason": finish_reason(final.finish_reason, output.has_tool_calls),
    }
    return JSONResponse(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_id,
            "choices": [choice],
            "usage": usage(final.prompt_tokens, final.completion_tokens),
        }
    )


async def _stream_chunks(
    state: AppState, stream: RequestStream, output: OutputProcessor, writer: ChunkWriter,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    yield writer.chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
    final = None
    async for event in stream:
        if event.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT, FinishReason.CANCELLED):
            error = APIError(500 if event.finish_reason == FinishReason.ERROR else 504,
                             event.error or "generation failed", code="generation_error")
            from .responses import sse

            yield sse(error.body())
            yield SSE_DONE
            return
        deltas = output.feed(event.text)
        if event.finished:
            deltas += output.finish()
        lp = {"content": logprob_content(event.logprobs, state.token_text)} if event.logprobs else None
        for i, delta in enumerate(deltas):
            yield writer.chunk({"index": 0, "delta": delta, "logprobs": lp if i == 0 else None, "finish_reason": None})
        if not deltas and lp:
            yield writer.chunk({"index": 0, "delta": {}, "logprobs": lp, "finish_reason": None})
        final = event
    yield writer.chunk(
        {"index": 0, "delta": {}, "logprobs": None,
         "finish_reason": finish_reason(final.finish_reason, output.has_tool_calls)}
    )
    if include_usage:
        yield writer.chunk(None, usage(final.prompt_tokens, final.completion_tokens))
    yield SSE_DONE
