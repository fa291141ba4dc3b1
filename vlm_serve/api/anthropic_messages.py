"""``POST /v1/messages``: Anthropic's Messages API on the chat path.

A request is translated into an OpenAI chat body, validated and prepared exactly as
``/v1/chat/completions`` would be, and its output (text, thinking, parsed tool calls)
comes back as Anthropic content blocks: streamed as Anthropic's named SSE events, or
folded from those same events into one message, so both agree.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.types import FinishReason, GenerationEvent
from .chat import start_chat
from .errors import APIError, bad_request
from .generation import deliver, run_to_end, stream_sse
from .output import OutputProcessor
from .responses import to_json
from .schemas import parse_chat_request
from .state import AppState, read_json

MESSAGES_PATH = "/v1/messages"

# Anthropic's error type for each status (other 4xx: invalid_request_error, other 5xx: api_error).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                500: "api_error", 504: "timeout_error", 529: "overloaded_error"}


def is_messages_path(path: str) -> bool:
    """Whether errors on ``path`` take Anthropic's shape (its sub-paths too, e.g. an
    unserved /v1/messages/count_tokens)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def _status(exc: APIError) -> int:
    # A full queue or a server shutting down is OpenAI's 503; Anthropic says 529 "overloaded".
    return 529 if exc.status == 503 else exc.status


def error_body(exc: APIError) -> dict:
    status = _status(exc)
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=_status(exc), headers=exc.headers)


def event(name: str, body: dict) -> bytes:
    return f"event: {name}\ndata: {to_json(body)}\n\n".encode()


# -- request: Anthropic -> OpenAI chat ---------------------------------------------------


def _blocks(content: Any, where: str) -> list[dict]:
    """Message content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise bad_request(f"{where}: must be a string or an array of content blocks", where, "invalid_type")
    return content


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad_request(f"{where}.text: must be a string", f"{where}.text", "invalid_type")
    return block["text"]


def _image_url(block: dict, where: str) -> str:
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f"{where}.source: must be {{\"type\": \"base64\", \"media_type\", \"data\"}} or "
                      "{\"type\": \"url\", \"url\"}", f"{where}.source")


def _tool_result(block: dict, where: str, names: dict[str, str]) -> dict:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise bad_request(f"{where}.tool_use_id: must be a string", f"{where}.tool_use_id", "invalid_type")
    content = block.get("content", "")
    parts = _blocks(content, f"{where}.content")
    for k, part in enumerate(parts):
        if part.get("type") != "text":
            raise bad_request(f"{where}.content[{k}]: only text blocks are supported in a tool_result",
                              f"{where}.content[{k}].type")
    text = "".join(_text(p, f"{where}.content[{k}]") for k, p in enumerate(parts))
    message = {"role": "tool", "tool_call_id": call_id, "content": text}
    if call_id in names:  # some templates show the tool's name with its result
        message["name"] = names[call_id]
    return message


def _user(blocks: list[dict], where: str, names: dict[str, str]) -> list[dict]:
    """A user turn: its tool results as tool messages, then the rest as one user message."""
    results, parts = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}[{j}]", block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        elif kind == "tool_result":
            results.append(_tool_result(block, at, names))
        else:
            raise bad_request(f"{at}.type: unsupported block type {kind!r} in a user turn "
                              "(expected 'text', 'image' or 'tool_result')", f"{at}.type")
    return results + ([{"role": "user", "content": parts}] if parts or not results else [])


def _assistant(blocks: list[dict], where: str, names: dict[str, str]) -> dict:
    text, calls = [], []
    for j, block in enumerate(blocks):
        at, kind = f"{where}[{j}]", block.get("type")
        if kind == "text":
            text.append(_text(block, at))
        elif kind == "tool_use":
            call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(call_id, str) or not isinstance(name, str) or not isinstance(args, dict):
                raise bad_request(f"{at}: a tool_use block needs string 'id' and 'name' and an object 'input'", at)
            names[call_id] = name
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}})
        elif kind not in ("thinking", "redacted_thinking"):  # earlier thinking is not replayed
            raise bad_request(f"{at}.type: unsupported block type {kind!r} in an assistant turn "
                              "(expected 'text', 'tool_use' or 'thinking')", f"{at}.type")
    message: dict = {"role": "assistant", "content": "".join(text) or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return message


def _messages(body: dict) -> list[dict]:
    out = []
    system = body.get("system")
    if system is not None:
        blocks = _blocks(system, "system")
        if any(b.get("type") != "text" for b in blocks):
            raise bad_request("system: only text blocks are supported", "system")
        out.append({"role": "system", "content": "\n".join(_text(b, f"system[{i}]") for i, b in enumerate(blocks))})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages: must be a non-empty array of messages", "messages")
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer them
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role") if isinstance(msg, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be 'user' or 'assistant'", f"{where}.role")
        if "content" not in msg:
            raise bad_request(f"{where}.content: Field required", f"{where}.content", "missing_required_parameter")
        blocks = _blocks(msg["content"], f"{where}.content")
        if role == "user":
            out += _user(blocks, f"{where}.content", names)
        else:
            out.append(_assistant(blocks, f"{where}.content", names))
    return out


def _tools(body: dict) -> list[dict]:
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise bad_request("tools: must be an array", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(tools):
        ok = isinstance(tool, dict) and tool.get("type", "custom") == "custom" and isinstance(tool.get("name"), str)
        if not ok:
            raise bad_request(f"tools[{i}]: must be a custom tool {{\"name\", \"description\", \"input_schema\"}}",
                              f"tools[{i}]")
        fn = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(body: dict):
    choice = body.get("tool_choice")
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice: must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                      "{\"type\": \"tool\", \"name\"}", "tool_choice")


def chat_body(body: Any) -> dict:
    """The OpenAI chat body of an Anthropic Messages request (its shape checked here;
    the rest, sampling ranges included, by the chat validation)."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    if body.get("max_tokens") is None:
        raise bad_request("max_tokens: Field required", "max_tokens", "missing_required_parameter")
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise bad_request("stop_sequences: must be an array of strings", "stop_sequences", "invalid_type")
    chat = {"messages": _messages(body), "tools": _tools(body), "tool_choice": _tool_choice(body), "stop": stop}
    for key in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream"):
        chat[key] = body.get(key)
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        # Templates that can think (Gemma 4, Qwen 3) read this variable; others ignore it.
        chat["chat_template_kwargs"] = {"enable_thinking": thinking["type"] == "enabled"}
    return {k: v for k, v in chat.items() if v is not None}


# -- response: output deltas -> content blocks -----------------------------------------


class BlockWriter:
    """Turns output deltas into Anthropic content-block events, one block open at a time."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # the type of the open block
        self._block_of_call: dict[int, int] = {}

    def feed(self, deltas: list[dict]) -> list[tuple[str, dict]]:
        out = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                out += self._text("thinking", delta["reasoning_content"])
            if delta.get("content"):
                out += self._text("text", delta["content"])
            for call in delta.get("tool_calls", []):
                out += self._call(call)
        return out

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _start(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [("content_block_start", {"type": "content_block_start", "index": self.index,
                                               "content_block": block})]

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        out = []
        if self.open != kind:
            block = {"type": "text", "text": ""} if kind == "text" else {"type": "thinking", "thinking": "", "signature": ""}
            out = self._start(kind, block)
        delta = {"type": "text_delta", "text": text} if kind == "text" else {"type": "thinking_delta", "thinking": text}
        return out + [("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})]

    def _call(self, call: dict) -> list[tuple[str, dict]]:
        out = []
        fn = call.get("function", {})
        if call.get("id") is not None:
            out = self._start("tool_use", {"type": "tool_use", "id": call["id"], "name": fn.get("name", ""), "input": {}})
            self._block_of_call[call["index"]] = self.index
        if fn.get("arguments"):
            delta = {"type": "input_json_delta", "partial_json": fn["arguments"]}
            index = self._block_of_call.get(call["index"], self.index)
            out.append(("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}))
        return out


def stop_reason(final: GenerationEvent, output: OutputProcessor) -> tuple[str, str | None]:
    if final.finish_reason == FinishReason.LENGTH:
        return "max_tokens", None
    if output.has_tool_calls:
        return "tool_use", None
    stop = final.stats.get("stop_string")
    return ("stop_sequence", stop) if stop else ("end_turn", None)


def fold(events: list[tuple[str, dict]]) -> list[dict]:
    """The content blocks that a run of block events describes."""
    blocks, args = [], {}
    for name, body in events:
        if name == "content_block_start":
            blocks.append(dict(body["content_block"]))
        elif name == "content_block_delta":
            block, delta = blocks[body["index"]], body["delta"]
            if delta["type"] == "input_json_delta":
                args[body["index"]] = args.get(body["index"], "") + delta["partial_json"]
            else:
                field = "text" if delta["type"] == "text_delta" else "thinking"
                block[field] += delta[field]
    for index, text in args.items():
        try:
            blocks[index]["input"] = json.loads(text)
        except json.JSONDecodeError:  # the parsers emit JSON; never fail a response on it
            blocks[index]["input"] = {}
    return blocks


# -- the route ----------------------------------------------------------------------------


async def messages(request: Request) -> Response:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    chat = parse_chat_request(chat_body(body), state.loaded.vocab_size, state.loaded.sampling_defaults)
    try:
        state.check_model(chat.model)
    except APIError as exc:
        exc.status = 404  # Anthropic answers a model it does not serve with not_found_error
        raise
    message_id = f"msg_{secrets.token_hex(12)}"
    prepared, events, output = await start_chat(state, chat, message_id)
    head = {"id": message_id, "type": "message", "role": "assistant", "model": state.model_id}
    stream = None
    if chat.stream:
        stream = _stream(state, events, output, head, prepared.num_prompt_tokens)
    return await deliver(state, request, message_id, stream, lambda: _respond(events, output, head))


async def _respond(events, output: OutputProcessor, head: dict) -> JSONResponse:
    done = await run_to_end(events)
    writer = BlockWriter()
    blocks = writer.feed(output.feed(done.text) + output.finish()) + writer.close()
    reason, stop = stop_reason(done.final, output)
    return JSONResponse({
        **head, "content": fold(blocks), "stop_reason": reason, "stop_sequence": stop,
        "usage": {"input_tokens": done.final.prompt_tokens, "output_tokens": done.final.completion_tokens},
    })


def _stream(state: AppState, events, output: OutputProcessor, head: dict, prompt_tokens: int):
    writer = BlockWriter()

    def chunks_for(ev: GenerationEvent) -> list[bytes]:
        deltas = output.feed(ev.text) + (output.finish() if ev.finished else [])
        return [event(name, body) for name, body in writer.feed(deltas)]

    def final_chunks(ev: GenerationEvent) -> list[bytes]:
        reason, stop = stop_reason(ev, output)
        usage = {"input_tokens": ev.prompt_tokens, "output_tokens": ev.completion_tokens}
        closing = writer.close() + [
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": stop},
                               "usage": usage}),
            ("message_stop", {"type": "message_stop"}),
        ]
        return [event(name, body) for name, body in closing]

    async def body():
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None,
                 "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}
        yield event("message_start", {"type": "message_start", "message": start})
        yield event("ping", {"type": "ping"})
        async for chunk in stream_sse(events, chunks_for, final_chunks,
                                      error_chunk=lambda exc: event("error", error_body(exc)), done=b""):
            yield chunk

    return body()
