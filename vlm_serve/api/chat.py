"""``POST /v1/chat/completions``: validate, prepare on the CPU pool, generate, respond."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.memory import KVBudgetExceeded
from ..engine.types import GenerationEvent, PreparedRequest
from ..preprocess.prompt import PromptError, chat_images, check_prompt_size, prepare_chat
from ..preprocess.tool_prompt import text_of
from ..tools.grammar import enforces, tool_call_grammar
from .errors import APIError, bad_request
from .choices import UsageTally, fan_out, merged, run_all, start_all
from .generation import deliver, start, stream_sse
from .output import OutputProcessor, merge_deltas
from .responses import ChunkWriter, finish_reason, logprob_content, new_id
from .schemas import ChatRequest, parse_chat_request
from .state import AppState, read_json


async def chat_completions(request: Request) -> Response:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    chat = parse_chat_request(body, state.loaded.vocab_size, state.loaded.sampling_defaults)
    state.check_model(chat.model)
    completion_id = new_id("chatcmpl")
    # n choices: n copies of the prepared prompt, prefilled once, each its own row.
    choices = fan_out([await prepare_chat_request(state, chat, completion_id)], chat.n, completion_id)
    streams = start_all(state, choices, chat.n)
    outputs = [state.output_processor(chat) for _ in choices]
    tally = UsageTally(choices, chat.n)
    stream = _stream(state, merged(streams), outputs, tally, completion_id, chat) if chat.stream else None
    return await deliver(
        state, request, [c.request_id for c in choices], stream,
        lambda: _respond(state, streams, outputs, tally, completion_id),
    )


async def start_chat(state: AppState, chat: ChatRequest, request_id: str):
    """Prepare a validated chat (images, template, tokens) and submit it: the prepared
    request, its events and the output processor for its text. Shared with the
    Anthropic Messages route."""
    prepared = await prepare_chat_request(state, chat, request_id)
    return prepared, start(state, prepared), state.output_processor(chat)


async def prepare_chat_request(state: AppState, chat: ChatRequest, request_id: str) -> PreparedRequest:
    """Images, template and tokens of a validated chat, within the context's limits."""
    enforce_tool_choice(state, chat)
    ctx = state.prompt_context
    text_bytes = sum(len(text_of(m.get("content")).encode()) for m in chat.messages)
    try:
        check_prompt_size(ctx, text_bytes)
        refs = chat_images(ctx, chat.messages)
    except PromptError as exc:
        raise bad_request(exc.message, exc.param, exc.code) from exc
    images = await state.load_images(refs)
    prepared = await state.run_cpu(
        prepare_chat, ctx, request_id, chat.messages, chat.sampling,
        chat.active_tools, chat.chat_template_kwargs, images, text_bytes=text_bytes,
    )
    state.apply_limits(prepared, chat.max_tokens)
    check_kv_memory(state, prepared, chat.max_tokens is not None, "messages")
    return prepared


def check_kv_memory(state: AppState, prepared: PreparedRequest, explicit_max_tokens: bool,
                    prompt_param: str) -> None:
    """Refuse (400, before it is queued) a request whose KV could never fit the server's
    memory limit, however long it waited. A max_tokens the client did not set is the
    server's default: it is lowered to what fits instead."""
    budget = state.engine.memory
    if not explicit_max_tokens:
        fits = budget.fits_tokens(prepared)
        if 1 <= fits < prepared.sampling.max_tokens:
            prepared.sampling.max_tokens = fits
    try:
        budget.check(prepared, prompt_param)
    except KVBudgetExceeded as exc:
        raise APIError(400, exc.message, param=exc.param, code="kv_cache_memory_exceeded") from exc


def enforce_tool_choice(state: AppState, chat: ChatRequest) -> None:
    """``tool_choice`` "required" or a named function becomes a grammar: one call of an
    allowed tool in the model's tool-call format."""
    fmt = getattr(state.tool_parser, "name", None)
    if not enforces(fmt, chat.tool_choice):
        if fmt is None and (chat.tool_choice == "required" or isinstance(chat.tool_choice, dict)):
            raise bad_request("tool_choice 'required' or a named function needs a tool-call format, and none is "
                              "known for this model's chat template (start the server with --tool-call-parser)",
                              "tool_choice")
        return
    if chat.sampling.grammar is not None:
        raise bad_request("'response_format' cannot be combined with tool_choice 'required' or a named "
                          "function", "tool_choice")
    tokenizer = state.loaded.tokenizer

    def marker_token(text: str) -> int | None:
        ids = tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    try:
        chat.sampling.grammar = tool_call_grammar(fmt, chat.active_tools, marker_token)
    except ValueError as exc:
        raise bad_request(str(exc), "tools") from exc


async def _respond(state: AppState, streams, outputs: list[OutputProcessor], tally: UsageTally,
                   completion_id: str):
    choices = []
    for i, (done, output) in enumerate(zip(await run_all(streams), outputs)):
        tally.add(done.final)
        deltas = output.feed(done.text) + output.finish()
        lp = {"content": logprob_content(done.logprobs, state.token_text)} if done.logprobs else None
        choices.append({
            "index": i,
            "message": merge_deltas(deltas),
            "logprobs": lp,
            "finish_reason": finish_reason(done.final.finish_reason, output.has_tool_calls),
        })
    return JSONResponse(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_id,
            "choices": choices,
            "usage": tally.usage(),
        }
    )


def _stream(state: AppState, events, outputs: list[OutputProcessor], tally: UsageTally,
            completion_id: str, chat: ChatRequest):
    writer = ChunkWriter(completion_id, state.model_id)

    def chunk(index: int, delta: dict, lp=None, reason=None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return writer.chunk(choice, tally.usage() if chat.continuous_usage else None)

    def chunks_for(event: GenerationEvent) -> list[bytes]:
        i = tally.add(event)
        output = outputs[i]
        deltas = output.feed(event.text)
        if event.finished:
            deltas += output.finish()
        lp = {"content": logprob_content(event.logprobs, state.token_text)} if event.logprobs else None
        if lp and not deltas:
            deltas = [{}]
        return [chunk(i, d, lp if k == 0 else None) for k, d in enumerate(deltas)]

    def final_chunks(event: GenerationEvent) -> list[bytes]:
        i = tally.index[event.request_id]
        out = [chunk(i, {}, reason=finish_reason(event.finish_reason, outputs[i].has_tool_calls))]
        if chat.include_usage and tally.unfinished == 0:  # after the last choice ends
            out.append(writer.chunk(None, tally.usage()))
        return out

    async def body():
        for i in range(len(outputs)):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for piece in stream_sse(events, chunks_for, final_chunks):
            yield piece

    return body()
