"""OpenAI response and stream-chunk shapes."""

from __future__ import annotations

import json
import math
import secrets
import time

from ..engine.types import FinishReason, GenerationEvent, TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(final: GenerationEvent) -> dict:
    """OpenAI usage from a request's final event (prompt tokens served from the prefix
    cache are reported as ``cached_tokens``)."""
    return {
        "prompt_tokens": final.prompt_tokens,
        "completion_tokens": final.completion_tokens,
        "total_tokens": final.prompt_tokens + final.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": final.stats.get("cached_tokens", 0)},
    }


def finish_reason(reason: FinishReason, has_tool_calls: bool = False) -> str:
    if has_tool_calls and reason == FinishReason.STOP:
        return "tool_calls"
    return "length" if reason == FinishReason.LENGTH else "stop"


LOGPROB_FLOOR = -9999.0  # what OpenAI reports for impossible tokens, instead of -inf


def finite_logprob(value: float) -> float:
    """A logprob fit for JSON: tokens a grammar or bias rules out are -inf; report them
    as OpenAI does."""
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


def logprob_content(logprobs: list[TokenLogprob], token_text) -> list[dict]:
    """OpenAI ``logprobs.content`` entries; ``token_text`` maps a token id to its text."""
    out = []
    for lp in logprobs:
        text = token_text(lp.token_id)
        out.append(
            {
                "token": text,
                "logprob": finite_logprob(lp.logprob),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {"token": token_text(t), "logprob": finite_logprob(v), "bytes": list(token_text(t).encode("utf-8"))}
                    for t, v in lp.top
                ],
            }
        )
    return out


class ChunkWriter:
    """Builds the SSE events of one streamed chat completion."""

    def __init__(self, completion_id: str, model: str, obj: str = "chat.completion.chunk"):
        self.id = completion_id
        self.model = model
        self.object = obj
        self.created = int(time.time())

    def chunk(self, choice: dict | None, usage_: dict | None = None) -> bytes:
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice is not None else [],
        }
        if usage_ is not None:
            body["usage"] = usage_
        return sse(body)


# allow_nan=False, as Starlette's JSONResponse: a stray NaN fails loudly instead of
# reaching a client as invalid JSON. One encoder for every chunk: json.dumps with
# options builds a new one per call, a cost paid per streamed token.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False)


def to_json(body) -> str:
    """``json.dumps(body, ensure_ascii=False, allow_nan=False)``, with a shared encoder."""
    return _ENCODER.encode(body)


def sse(body: dict) -> bytes:
    return f"data: {to_json(body)}\n\n".encode("utf-8")


SSE_DONE = b"data: [DONE]\n\n"
SSE_HEARTBEAT = b": keep-alive\n\n"  # an SSE comment: clients skip it
