"""``POST /v1/chat/completions``: validate, prepare on the CPU pool, generate, respond."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.types import GenerationEvent
from ..preprocess.prompt import PromptError, chat_images, check_prompt_size, prepare_chat
from ..preprocess.tool_prompt import text_of
from .errors import bad_request
from .generation import deliver, run_to_end, start, stream_sse
from .output import OutputProcessor, merge_deltas
from .responses import ChunkWriter, finish_reason, logprob_content, new_id, usage
from .schemas import ChatRequest, parse_chat_request
from .state import AppState, read_json


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    chat = parse_chat_request(body, state.loaded.vocab_size, state.loaded.sampling_defaults)
    state.check_model(chat.model)
    completion_id = new_id("chatcmpl")
    ctx = state.prompt_context
    text_bytes = sum(len(text_of(m.get("content")).encode()) for m in chat.messages)
    try:
        check_prompt_size(ctx, text_bytes)
        refs = chat_images(ctx, chat.messages)
    except PromptError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc
    images = await state.load_images(refs)
    prepared = await state.run_cpu(
        prepare_chat, ctx, completion_id, chat.messages, chat.sampling,
        chat.active_tools, chat.chat_template_kwargs, images, text_bytes=text_bytes,
    )
    state.apply_limits(prepared, chat.max_tokens)
    events = start(state, prepared)
    output = state.output_processor(chat)
    stream = _stream(state, events, output, completion_id, chat) if chat.stream else None
    return await deliver(
        state, request, completion_id, stream, lambda: _respond(state, events, output, completion_id)
    )


async def _respond(state: AppState, events, output: OutputProcessor, completion_id: str):
    done = await run_to_end(events)
    deltas = output.feed(done.text) + output.finish()
    lp = {"content": logprob_content(done.logprobs, state.token_text)} if done.logprobs else None
    return JSONResponse(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_id,
            "choices": [
                {
                    "index": 0,
                    "message": merge_deltas(deltas),
                    "logprobs": lp,
                    "finish_reason": finish_reason(done.final.finish_reason, output.has_tool_calls),
                }
            ],
            "usage": usage(done.final),
        }
    )


def _stream(state: AppState, events, output: OutputProcessor, completion_id: str, chat: ChatRequest):
    writer = ChunkWriter(completion_id, state.model_id)

    def choice(delta: dict, lp=None, reason=None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}

    def chunks_for(event: GenerationEvent) -> list[bytes]:
        deltas = output.feed(event.text)
        if event.finished:
            deltas += output.finish()
        lp = {"content": logprob_content(event.logprobs, state.token_text)} if event.logprobs else None
        if lp and not deltas:
            deltas = [{}]
        return [writer.chunk(choice(d, lp if i == 0 else None)) for i, d in enumerate(deltas)]

    def final_chunks(event: GenerationEvent) -> list[bytes]:
        out = [writer.chunk(choice({}, reason=finish_reason(event.finish_reason, output.has_tool_calls)))]
        if chat.include_usage:
            out.append(writer.chunk(None, usage(event)))
        return out

    async def body():
        yield writer.chunk(choice({"role": "assistant", "content": ""}))
        async for chunk in stream_sse(events, chunks_for, final_chunks, state.heartbeat_s):
            yield chunk

    return body()
