"""``POST /v1/completions``: plain text prompts, same sampling as chat.

``prompt`` is a string, a list of token ids, or a list of several of either: several
prompts make several choices (``n`` of each, prompt by prompt), as in OpenAI's API.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.types import GenerationEvent, PreparedRequest, SamplingParams, TokenLogprob
from ..preprocess.prompt import prepare_prompt
from .chat import check_kv_memory
from .choices import UsageTally, fan_out, merged, run_all, start_all
from .errors import bad_request
from .generation import deliver, stream_sse
from .responses import ChunkWriter, finish_reason, new_id
from .schemas import choice_count, sampling_from, usage_options
from .state import AppState, read_json

MAX_PROMPTS = 64  # prompts in one request; each is n rows of the batch


@dataclass
class Prompt:
    text: str | None = None  # a string prompt, tokenized here
    ids: list[int] | None = None  # or its token ids, used as given


def _is_ids(value) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def _prompts(body, vocab_size: int) -> list[Prompt]:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    prompt = body.get("prompt")
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, str) or _is_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not (
        all(isinstance(p, str) for p in prompt) or all(_is_ids(p) for p in prompt)
    ):
        raise bad_request("'prompt' must be a string, an array of token ids, or an array of "
                          "strings or of token-id arrays", "prompt", "invalid_type")
    if len(prompt) > MAX_PROMPTS:
        raise bad_request(f"'prompt' holds {len(prompt)} prompts, over the limit of {MAX_PROMPTS}", "prompt")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(Prompt(text=p))
        elif not all(0 <= t < vocab_size for t in p):
            raise bad_request(f"'prompt' token ids must be in [0, {vocab_size})", "prompt")
        else:
            out.append(Prompt(ids=p))
    return out


def _legacy_logprobs(state: AppState, logprobs: list[TokenLogprob]) -> dict:
    tokens = [state.token_text(lp.token_id) for lp in logprobs]
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{state.token_text(t): v for t, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


async def _prepare(state: AppState, prompt: Prompt, request_id: str, sampling: SamplingParams,
                   max_tokens: int | None) -> PreparedRequest:
    if prompt.ids is not None:
        prepared = PreparedRequest(request_id, np.asarray(prompt.ids, np.int32), sampling)
    else:
        prepared = await state.run_cpu(
            prepare_prompt, state.prompt_context, request_id, prompt.text, sampling, (), True,
            text_bytes=len(prompt.text.encode()),
        )
    state.apply_limits(prepared, max_tokens if max_tokens is not None else 16)
    check_kv_memory(state, prepared, max_tokens is not None, "prompt")
    return prepared


async def completions(request: Request) -> Response:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    prompts = _prompts(body, state.loaded.vocab_size)
    # The legacy API's `logprobs` is a count of top alternatives, not a flag.
    legacy_lp = body.get("logprobs")
    if legacy_lp is not None and (isinstance(legacy_lp, bool) or not isinstance(legacy_lp, int) or not 0 <= legacy_lp <= 20):
        raise bad_request("'logprobs' must be an integer between 0 and 20", "logprobs")
    echo = body.get("echo") is True
    if echo and legacy_lp is not None:
        raise bad_request("'echo' with 'logprobs' is not supported (prompt logprobs are not computed)",
                          "echo", "unsupported_value")
    fields = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    sampling, max_tokens = sampling_from(fields, state.loaded.vocab_size, state.loaded.sampling_defaults)
    if legacy_lp is not None:
        sampling.logprobs, sampling.top_logprobs = True, legacy_lp
    n = choice_count(body)
    include_usage, continuous_usage = usage_options(body)
    state.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
    completion_id = new_id("cmpl")
    prepared = await asyncio.gather(*(
        _prepare(state, p, f"{completion_id}-p{i}", sampling, max_tokens) for i, p in enumerate(prompts)
    ))
    choices = fan_out(list(prepared), n, completion_id)
    # Echo: each choice's text begins with its prompt (token-id prompts decoded).
    echoes = [""] * len(choices)
    if echo:
        texts = [p.text if p.text is not None else state.loaded.tokenizer.decode(p.ids) for p in prompts]
        echoes = [texts[i // n] for i in range(len(choices))]
    streams = start_all(state, choices, n)
    tally = UsageTally(choices, n)
    stream = None
    if body.get("stream") is True:
        stream = _stream(state, merged(streams), tally, echoes, completion_id, include_usage, continuous_usage)
    return await deliver(state, request, [c.request_id for c in choices], stream,
                         lambda: _respond(state, streams, tally, echoes, completion_id))


async def _respond(state: AppState, streams, tally: UsageTally, echoes: list[str], completion_id: str):
    choices = []
    for i, done in enumerate(await run_all(streams)):
        tally.add(done.final)
        choices.append({
            "index": i,
            "text": echoes[i] + done.text,
            "logprobs": _legacy_logprobs(state, done.logprobs) if done.logprobs else None,
            "finish_reason": finish_reason(done.final.finish_reason),
        })
    return JSONResponse(
        {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_id,
            "choices": choices,
            "usage": tally.usage(),
        }
    )


def _stream(state: AppState, events, tally: UsageTally, echoes: list[str], completion_id: str,
            include_usage: bool, continuous_usage: bool):
    writer = ChunkWriter(completion_id, state.model_id, obj="text_completion")

    def chunk(index: int, text: str, lp=None, reason=None) -> bytes:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
        return writer.chunk(choice, tally.usage() if continuous_usage else None)

    def chunks_for(event: GenerationEvent) -> list[bytes]:
        i = tally.add(event)
        if not event.text and not event.logprobs:
            return []
        lp = _legacy_logprobs(state, event.logprobs) if event.logprobs else None
        return [chunk(i, event.text, lp)]

    def final_chunks(event: GenerationEvent) -> list[bytes]:
        out = [chunk(tally.index[event.request_id], "", reason=finish_reason(event.finish_reason))]
        if include_usage and tally.unfinished == 0:  # after the last choice ends
            out.append(writer.chunk(None, tally.usage()))
        return out

    async def body():
        for i, text in enumerate(echoes):
            if text:
                yield chunk(i, text)
        async for piece in stream_sse(events, chunks_for, final_chunks):
            yield piece

    return body()
