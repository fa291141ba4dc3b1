"""``POST /v1/responses``: OpenAI's Responses API, served by the chat path.

The request's input items become chat messages and its flat function tools chat tools;
the chat path validates, prepares, generates and parses tool calls; the message deltas it
yields become Responses output items (``message``, ``function_call``, ``reasoning``),
streamed as typed events. Nothing is stored: ``store`` is ignored and
``previous_response_id`` is refused, so a client sends the whole conversation each turn.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.types import FinishReason, GenerationEvent
from .chat import start_chat
from .errors import APIError, bad_request
from .generation import deliver, error_of, stream_sse
from .responses import logprob_content, to_json
from .schemas import parse_chat_request
from .state import AppState, read_json

# Responses fields with a chat-completions field of the same meaning, and the sampling
# extensions chat accepts (as vLLM's Responses route does).
_RENAMED = {"model": "model", "stream": "stream", "temperature": "temperature", "top_p": "top_p",
            "max_output_tokens": "max_tokens"}
_EXTENSIONS = ("top_k", "min_p", "seed", "stop", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "chat_template_kwargs")
_STATEFUL = ("previous_response_id", "conversation")
# What OpenAI's ``include`` takes. Only the logprobs change anything here; the others name
# outputs this server never makes (agents send reasoning.encrypted_content with store off).
_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
               "message.input_image.image_url", "computer_call_output.output.image_url",
               "code_interpreter_call.outputs", "reasoning.encrypted_content", _LOGPROBS)


def _id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


# ---- request: Responses body -> chat-completions body --------------------------------


def chat_body(body: Any) -> tuple[dict, list[tuple[str, bool]]]:
    """The chat-completions body that means what a Responses body means, and for each of
    its messages the Responses field it came from (and whether that was a message item,
    whose content parts map one to one), so chat's errors can name the client's field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    for name in _STATEFUL:
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is not supported: this server keeps no state; send the "
                              "whole conversation in 'input'", name, "unsupported_parameter")
    if body.get("background"):
        raise bad_request("background responses are not supported", "background", "unsupported_parameter")
    messages: list[dict] = []
    origins: list[tuple[str, bool]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_request("'instructions' must be a string", "instructions", "invalid_type")
        messages.append({"role": "system", "content": instructions})
        origins.append(("instructions", False))
    _input_messages(body.get("input"), messages, origins)
    out = {new: body[old] for old, new in _RENAMED.items() if old in body}
    out.update({name: body[name] for name in _EXTENSIONS if name in body})
    out["messages"] = messages
    out["tools"] = _tools(body.get("tools"))
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    out.update(_logprobs(body))
    return out, origins


def _logprobs(body: dict) -> dict:
    """``include: ["message.output_text.logprobs"]`` and ``top_logprobs`` -> chat's
    ``logprobs`` / ``top_logprobs``. As OpenAI does, ``top_logprobs`` alone returns none."""
    include = body.get("include")
    if include is None:
        include = []
    if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
        raise bad_request("Invalid type for 'include': expected an array of strings.", "include", "invalid_type")
    for i, value in enumerate(include):
        if value not in _INCLUDABLE:
            supported = ", ".join(f"'{v}'" for v in _INCLUDABLE)
            raise bad_request(f"Invalid value: '{value}'. Supported values are: {supported}.", f"include[{i}]")
    top = body.get("top_logprobs")
    if top is not None:
        if not isinstance(top, int) or isinstance(top, bool):
            raise bad_request("Invalid type for 'top_logprobs': expected an integer.", "top_logprobs", "invalid_type")
        if top < 0:
            raise bad_request(f"Invalid 'top_logprobs': integer below minimum value. Expected a value >= 0, but "
                              f"got {top} instead.", "top_logprobs", "integer_below_min_value")
        if top > 20:
            raise bad_request(f"Invalid 'top_logprobs': integer above maximum value. Expected a value <= 20, but "
                              f"got {top} instead.", "top_logprobs", "integer_above_max_value")
    if _LOGPROBS not in include:
        return {}
    return {"logprobs": True, "top_logprobs": top or 0}


def _input_messages(items: Any, messages: list[dict], origins: list) -> None:
    if items is None:
        raise bad_request("'input' is required", "input", "missing_required_parameter")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        origins.append(("input", False))
        return
    if not isinstance(items, list):
        raise bad_request("'input' must be a string or an array of input items", "input", "invalid_type")
    if not items:
        raise bad_request("'input' must contain at least one item", "input")
    call_names: dict[str, str] = {}  # call_id -> function name, for the tool results
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"'{where}' must be an object", where, "invalid_type")
        kind = item.get("type", "message")  # the short form {"role", "content"} has no type
        if kind == "message":
            messages.append(_message(item, where))
            origins.append((where, True))
        elif kind == "function_call":
            name, arguments = _string(item, "name", where), _string(item, "arguments", where, "")
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": name, "arguments": arguments}}
            call_names[call["id"]] = call["function"]["name"]
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # chat's shape: one turn, text and calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append((where, False))
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            result = {"role": "tool", "tool_call_id": call_id, "content": _output(item, where)}
            if call_id in call_names:
                result["name"] = call_names[call_id]
            messages.append(result)
            origins.append((where, False))
        elif kind == "reasoning":
            continue  # earlier thinking is not replayed: chat templates drop it too
        else:
            raise bad_request(f"unsupported input item type {kind!r} (expected 'message', 'function_call' "
                              "or 'function_call_output')", f"{where}.type")


def _string(item: dict, key: str, where: str, default: str | None = None) -> str:
    value = item.get(key, default)
    if not isinstance(value, str) or (default is None and not value):
        raise bad_request(f"'{where}.{key}' must be a non-empty string", f"{where}.{key}", "invalid_type")
    return value


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise bad_request(f"'{where}.role' must be one of 'user', 'system', 'developer', 'assistant'",
                          f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or an array of content parts",
                          f"{where}.content", "invalid_type")
    return {"role": role, "content": [_part(part, f"{where}.content[{j}]", role) for j, part in enumerate(content)]}


def _part(part: Any, where: str, role: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": _string(part, "text", where, "")}
    if kind == "input_image":
        if role != "user":
            raise bad_request("images are only supported in user messages", where)
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise bad_request(f"'{where}.image_url' must be a non-empty string (a data: or http(s) URL; "
                              "file_id is not supported)", f"{where}.image_url", "invalid_type")
        return {"type": "image_url", "image_url": {"url": url}}
    raise bad_request(f"unsupported content part type {kind!r} (expected 'input_text', 'input_image' "
                      "or 'output_text')", f"{where}.type")


def _output(item: dict, where: str) -> str:
    """A tool result: a string, or a list of input_text parts (joined)."""
    output = item.get("output")
    if isinstance(output, list) and all(isinstance(p, dict) and p.get("type") == "input_text" for p in output):
        return "".join(_string(p, "text", f"{where}.output[{j}]", "") for j, p in enumerate(output))
    if not isinstance(output, str):
        raise bad_request(f"'{where}.output' must be a string or an array of input_text parts",
                          f"{where}.output", "invalid_type")
    return output


def _tools(tools: Any) -> list[dict]:
    """Flat Responses function tools -> chat tools."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", "tools", "invalid_type")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request("only function tools are supported ({\"type\": \"function\", \"name\", ...})",
                              f"{where}.type")
        fn = {"name": _string(tool, "name", where)}
        for key, kind in (("description", str), ("parameters", dict)):
            if tool.get(key) is not None:
                if not isinstance(tool[key], kind):
                    raise bad_request(f"'{where}.{key}' has the wrong type", f"{where}.{key}", "invalid_type")
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any):
    if isinstance(choice, str):
        return choice  # auto, none, required: chat checks them
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                      "\"name\": ...}", "tool_choice")


def _text_format(text: Any) -> dict | None:
    """``text.format`` -> chat's ``response_format``."""
    if text is None or (isinstance(text, dict) and text.get("format") is None):
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object with a 'type'", "text.format", "invalid_type")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    raise bad_request(f"unknown text.format type {kind!r} (expected 'text', 'json_object' or 'json_schema')",
                      "text.format.type")


def _param(param: str | None, origins: list[tuple[str, bool]]) -> str | None:
    """A chat field name -> the Responses field the client sent."""
    if param is None:
        return None
    if param == "messages":
        return "input"
    m = re.fullmatch(r"messages\[(\d+)\](.*)", param)
    if m:
        where, is_message = origins[int(m[1])]
        rest = m[2] if is_message and m[2].startswith(".content") else ""
        return where + rest.replace(".image_url.url", ".image_url")
    if param.startswith("response_format"):
        return "text.format.schema" if param == "response_format.json_schema" else "text.format"
    return {"max_tokens": "max_output_tokens"}.get(param, param)


# ---- output: message deltas -> output items and typed events ---------------------------


class ResponseWriter:
    """Builds one response from the chat path's message deltas: its output items, in the
    order the model produced them, and the typed SSE events that announce them. The
    non-streamed response is built the same way (its events unused), so both agree.

    Token logprobs (chat's ``logprobs.content`` entries) go with the message text their
    tokens produced (OpenAI gives logprobs on ``output_text`` parts only): see
    :class:`PendingLogprobs`."""

    _TEXT = {"message": ("output_text", "response.output_text"),
             "reasoning": ("reasoning_text", "response.reasoning_text")}

    def __init__(self, response: dict, logprobs: bool = False):
        self.response = response
        self.seq = 0
        self.open: dict | None = None  # the item receiving deltas; items never interleave
        self._logprobs = PendingLogprobs() if logprobs else None

    def event(self, kind: str, **fields) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        data = to_json(body)  # serialized now: a snapshot
        return f"event: {kind}\ndata: {data}\n\n".encode("utf-8")

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def feed(self, deltas: list[dict], text: str = "", logprobs: list[dict] = ()) -> list[bytes]:
        """The events for ``deltas``, made of a generation event's ``text`` (whose tokens'
        entries are ``logprobs``) and of text held back before it."""
        pending = self._logprobs
        if pending is not None:
            pending.add(text, logprobs)
        out = []
        for delta in deltas:
            if delta.get("reasoning_content"):
                if pending is not None:
                    pending.take(delta["reasoning_content"])  # thinking's tokens: not the message's
                out += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                entries = pending.take(delta["content"]) if pending is not None else []
                out += self._text("message", delta["content"], entries)
            for call in delta.get("tool_calls", []):
                if pending is not None:
                    pending.clear()  # the call's tokens
                out += self._call(call)
        return out

    def finish(self, final: GenerationEvent) -> list[bytes]:
        incomplete = final.finish_reason == FinishReason.LENGTH
        out = [] if self.response["output"] else self._open_text("message")  # never an empty output
        out += self._close("incomplete" if incomplete else "completed")
        self.response["status"] = "incomplete" if incomplete else "completed"
        if incomplete:
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        self.response["usage"] = {
            "input_tokens": final.prompt_tokens,
            "input_tokens_details": {"cached_tokens": final.stats.get("cached_tokens", 0)},
            "output_tokens": final.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": final.prompt_tokens + final.completion_tokens,
        }
        return out + [self.event(f"response.{self.response['status']}", response=self.response)]

    def failed(self, error: APIError) -> bytes:
        if self.open is not None:
            self.open["status"] = "incomplete"
        self.response["status"] = "failed"
        self.response["error"] = {"code": "server_error", "message": error.message}
        return self.event("response.failed", response=self.response)

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.response["output"]) - 1}

    def _add(self, item: dict) -> bytes:
        self.open = item
        self.response["output"].append(item)
        return self.event("response.output_item.added", output_index=len(self.response["output"]) - 1, item=item)

    def _open_text(self, kind: str) -> list[bytes]:
        item = {"type": kind, "id": _id("msg" if kind == "message" else "rs"), "status": "in_progress", "content": []}
        item.update({"role": "assistant"} if kind == "message" else {"summary": []})
        part = {"type": self._TEXT[kind][0], "text": ""}
        if kind == "message":
            part.update(annotations=[], logprobs=[])
        out = [self._add(item)]
        item["content"].append(part)
        return out + [self.event("response.content_part.added", **self._where(), content_index=0, part=part)]

    def _text(self, kind: str, text: str, logprobs: list[dict] = ()) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close("completed") + self._open_text(kind)
        part = self.open["content"][0]
        part["text"] += text
        extra = {}
        if kind == "message":
            part["logprobs"] += logprobs
            extra["logprobs"] = _event_logprobs(logprobs)
        return out + [self.event(f"{self._TEXT[kind][1]}.delta", **self._where(), content_index=0,
                                 delta=text, **extra)]

    def _call(self, call: dict) -> list[bytes]:
        out = []
        fn = call.get("function", {})
        if call.get("id"):  # a call's first delta (the parser ends one call before the next)
            out += self._close("completed")
            out.append(self._add({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                                  "name": fn.get("name", ""), "arguments": "", "status": "in_progress"}))
        if fn.get("arguments") and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=fn["arguments"]))
        return out

    def _close(self, status: str) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        out = []
        if item["type"] == "function_call":
            out.append(self.event("response.function_call_arguments.done", **self._where(),
                                  name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            extra = {"logprobs": _event_logprobs(part["logprobs"])} if item["type"] == "message" else {}
            out.append(self.event(f"{self._TEXT[item['type']][1]}.done", **self._where(), content_index=0,
                                  text=part["text"], **extra))
            out.append(self.event("response.content_part.done", **self._where(), content_index=0, part=part))
        item["status"] = status
        out.append(self.event("response.output_item.done", output_index=self._where()["output_index"], item=item))
        self.open = None
        return out


class PendingLogprobs:
    """Token logprobs waiting for the message text their tokens produced.

    The output processor gives text out in order, but may hold some back (a possible tool
    call) and drops what became a call, thinking, or a marker. Each generation event's text
    is queued with its tokens' entries; text that comes out is matched against the queue,
    and queued text that it skips was dropped, with its entries."""

    def __init__(self):
        self._queue: list[list] = []  # [text not yet accounted for, entries not yet given]

    def add(self, text: str, entries: list[dict]) -> None:
        if text or entries:
            self._queue.append([text, list(entries)])

    def clear(self) -> None:
        self._queue.clear()

    def take(self, text: str) -> list[dict]:
        """The entries of the tokens that produced ``text``."""
        out: list[dict] = []
        while text and self._queue:
            head = self._queue[0]
            queued, entries = head
            if not queued:  # part of a character: its text came with a later token
                out += entries
                self._queue.pop(0)
                continue
            # Where ``text`` starts in this event's text (an event's text may begin with
            # something dropped, such as a marker or the whitespace before a call).
            at = next((k for k in range(len(queued)) if text.startswith(queued[k:]) or queued.startswith(text, k)),
                      None)
            if at is None:  # this event's text was dropped
                self._queue.pop(0)
                continue
            out += entries
            rest = queued[at:]
            if text.startswith(rest):
                text = text[len(rest):]
                self._queue.pop(0)
            else:  # the event's text goes on past ``text``
                head[0], head[1], text = rest[len(text):], [], ""
        return out


def _event_logprobs(entries: list[dict]) -> list[dict]:
    """Logprobs in the text events' shape: no ``bytes`` (the output_text part has them)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


# ---- the route ------------------------------------------------------------------------


async def responses(request: Request) -> Response:
    state: AppState = request.app.state.vlm
    body = await read_json(request, state.config.max_request_bytes)
    converted, origins = chat_body(body)
    response_id = _id("resp")
    try:
        chat = parse_chat_request(converted, state.loaded.vocab_size, state.loaded.sampling_defaults)
        state.check_model(chat.model)
        _, events, output = await start_chat(state, chat, response_id)
    except APIError as exc:  # chat names chat's fields; the client sent Responses ones
        exc.param = _param(exc.param, origins)
        raise
    writer = ResponseWriter({
        "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": state.model_id, "output": [], "error": None, "incomplete_details": None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "metadata": body.get("metadata") if isinstance(body.get("metadata"), dict) else {},
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False, "previous_response_id": None, "store": False,
        "temperature": chat.sampling.temperature, "top_p": chat.sampling.top_p,
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [], "text": body.get("text") or {"format": {"type": "text"}},
        "top_logprobs": body.get("top_logprobs"), "usage": None,
    }, logprobs=chat.sampling.logprobs)

    def chunks_for(event: GenerationEvent) -> list[bytes]:
        deltas = output.feed(event.text) + (output.finish() if event.finished else [])
        entries = logprob_content(event.logprobs, state.token_text) if event.logprobs else []
        return writer.feed(deltas, event.text, entries)

    stream = _stream(state, events, chunks_for, writer) if chat.stream else None
    return await deliver(state, request, response_id, stream, lambda: _respond(events, chunks_for, writer))


async def _respond(events, chunks_for, writer: ResponseWriter) -> JSONResponse:
    """Built event by event as a stream is, so each token's logprobs meet its text."""
    final = None
    async for event in events:
        error = error_of(event)
        if error is not None:
            raise error
        chunks_for(event)
        final = event
    writer.finish(final)
    return JSONResponse(writer.response)


def _stream(state: AppState, events, chunks_for, writer: ResponseWriter):
    async def body():
        for chunk in writer.start():
            yield chunk
        # The Responses API ends with response.completed (or .failed), never [DONE].
        async for chunk in stream_sse(events, chunks_for, writer.finish,
                                      error_chunk=writer.failed, done=b""):
            yield chunk

    return body()
