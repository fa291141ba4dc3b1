"""``POST /v1/completions``: plain text prompts, same sampling as chat."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.types import GenerationEvent, TokenLogprob
from ..preprocess.prompt import prepare_prompt
from .errors import bad_request
from .generation import deliver, run_to_end, start, stream_sse
from .responses import ChunkWriter, finish_reason, new_id, usage
from .schemas import sampling_from
from .state import AppState, read_json


def _prompt(body) -> str:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string (or an array of one string)", "prompt", "invalid_type")
    return prompt


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


async def completions(request: Request) -> Response:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    prompt = _prompt(body)
    # The legacy API's `logprobs` is a count of top alternatives, not a flag.
    legacy_lp = body.get("logprobs")
    if legacy_lp is not None and (isinstance(legacy_lp, bool) or not isinstance(legacy_lp, int) or not 0 <= legacy_lp <= 20):
        raise bad_request("'logprobs' must be an integer between 0 and 20", "logprobs")
    fields = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    sampling, max_tokens = sampling_from(fields, state.loaded.vocab_size, state.loaded.sampling_defaults)
    if legacy_lp is not None:
        sampling.logprobs, sampling.top_logprobs = True, legacy_lp
    state.check_model(body.get("model") if isinstance(body.get("model"), str) else None)
    completion_id = new_id("cmpl")
    prepared = await state.run_cpu(
        prepare_prompt, state.prompt_context, completion_id, prompt, sampling, (), True,
        text_bytes=len(prompt.encode()),
    )
    state.apply_limits(prepared, max_tokens if max_tokens is not None else 16)
    events = start(state, prepared)
    stream_options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    stream = None
    if body.get("stream") is True:
        stream = _stream(state, events, completion_id, bool(stream_options.get("include_usage")))
    return await deliver(state, request, completion_id, stream, lambda: _respond(state, events, completion_id))


async def _respond(state: AppState, events, completion_id: str) -> JSONResponse:
    done = await run_to_end(events)
    return JSONResponse(
        {
            "id": completion_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_id,
            "choices": [
                {
                    "index": 0,
                    "text": done.text,
                    "logprobs": _legacy_logprobs(state, done.logprobs) if done.logprobs else None,
                    "finish_reason": finish_reason(done.final.finish_reason),
                }
            ],
            "usage": usage(done.final),
        }
    )


def _stream(state: AppState, events, completion_id: str, include_usage: bool):
    writer = ChunkWriter(completion_id, state.model_id, obj="text_completion")

    def chunks_for(event: GenerationEvent) -> list[bytes]:
        if not event.text and not event.logprobs:
            return []
        lp = _legacy_logprobs(state, event.logprobs) if event.logprobs else None
        return [writer.chunk({"index": 0, "text": event.text, "logprobs": lp, "finish_reason": None})]

    def final_chunks(event: GenerationEvent) -> list[bytes]:
        out = [writer.chunk({"index": 0, "text": "", "logprobs": None,
                             "finish_reason": finish_reason(event.finish_reason)})]
        if include_usage:
            out.append(writer.chunk(None, usage(event)))
        return out

    return stream_sse(events, chunks_for, final_chunks, state.heartbeat_s)
