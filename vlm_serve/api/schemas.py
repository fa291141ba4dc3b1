"""Validation of OpenAI request bodies into typed requests.

Every problem a client can cause becomes a 400 naming the offending field. Unknown
fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..engine.grammar import json_grammar
from ..engine.types import SamplingParams
from .errors import bad_request

_MISSING = object()
_ROLES = {"system", "developer", "user", "assistant", "tool"}
_INT32_MAX = 2**31 - 1  # the engine holds token counts and top_k as int32
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# Deep enough for any real JSON Schema or tool definition; shallow enough that nothing
# downstream (templates, grammar compiler, our own walks) runs out of stack.
MAX_JSON_DEPTH = 100


class _Constant(str):
    """A ``NaN``/``Infinity`` literal, kept as a marker until its field is known."""


# JSON's \uD800-\uDFFF escapes are the only way to put a lone surrogate into a string;
# such text cannot be encoded as UTF-8 (by the tokenizer, or by our own responses).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
# Bodies are decoded by msgspec first: a resent base64 image makes a chat body
# megabytes long, which it decodes in a quarter of the standard library's time, on the
# event loop. It refuses what is not strict UTF-8 JSON (non-finite numbers, lone
# surrogates, other encodings); those bodies go to the standard library, whose result
# the checks below turn into errors that name the field.
_FAST_JSON = msgspec.json.Decoder()


def decode_json(raw: bytes) -> Any:
    """Parse a request body, refusing what Python's json accepts but nobody should
    send: non-finite numbers (``NaN``, ``Infinity``, ``1e999``), lone surrogates and
    deep nesting."""
    try:
        body = _FAST_JSON.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        body = _decode_standard(raw)  # which says what is wrong, or decodes what msgspec cannot
    _check_json(body, texts=_has_surrogate_escape(raw))
    return body


def _decode_standard(raw: bytes) -> Any:
    try:
        return json.loads(raw, parse_constant=_Constant)
    except RecursionError:
        raise bad_request(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                          None, "invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, bad UTF-8, integers over 4300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}", None, "invalid_json") from None


def _has_surrogate_escape(raw: bytes) -> bool:
    """Whether ``raw`` has a surrogate escape (``\\ud800``-``\\udfff``). Its backslashes
    are found by a one-byte search (memchr), which passes over a multi-megabyte image
    body (base64 has none) in a thirtieth of the regex's time; past a few dozen
    escapes, the regex takes the rest."""
    at = raw.find(b"\\")
    for _ in range(64):
        if at < 0:
            return False
        if _SURROGATE_ESCAPE.match(raw, at):
            return True
        at = raw.find(b"\\", at + 1)
    return at >= 0 and _SURROGATE_ESCAPE.search(raw, at) is not None


def _check_json(body: Any, texts: bool) -> None:
    """One iterative walk (it cannot itself recurse too deep) over containers and
    numbers, and over strings too when ``texts`` (the body has surrogate escapes)."""
    stack = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, _Constant) or (isinstance(value, float) and not math.isfinite(value)):
            raise bad_request(f"'{path}' must be a finite number", path or None)
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):  # isascii: a flag, O(1)
                raise bad_request(f"'{path}' is not valid Unicode (a lone surrogate)", path or None)
            continue
        if isinstance(value, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise bad_request(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                                  path or None, "invalid_json")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if texts and isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                    raise bad_request(f"a key in '{path or 'the body'}' is not valid Unicode (a lone surrogate)",
                                      path or None)
                if isinstance(item, (dict, list, float, _Constant)) or (texts and isinstance(item, str)):
                    sub = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
                    stack.append((item, sub, depth + 1))


def _type_name(types) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "an array", dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _get(body: dict, name: str, types: tuple, default=None, param: str | None = None):
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    # bool is an int in Python; keep them apart.
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise bad_request(f"'{name}' must be {_type_name(types)}", param or name, "invalid_type")
    return value


def _number(body, name, default, lo, hi, above_lo=False):
    """A number in [lo, hi] (or (lo, hi] with ``above_lo``). NaN fails every comparison,
    so it is refused explicitly rather than slipping past the range check."""
    value = _get(body, name, (int, float), default)
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        raise bad_request(f"'{name}' must be a finite number", name)
    if not lo <= value <= hi or (above_lo and value == lo):
        interval = f"{'(' if above_lo else '['}{lo}, {hi}]"
        raise bad_request(f"'{name}' must be in {interval}, got {value}", name)
    return value


def _int(body, name, default, lo, hi, param=None):
    """An integer in [lo, hi]: everything past the edge is held in fixed-width ints."""
    value = _get(body, name, (int,), default, param)
    if value is not None and not lo <= value <= hi:
        raise bad_request(f"'{param or name}' must be an integer between {lo} and {hi}", param or name)
    return value


@dataclass
class ChatRequest:
    messages: list[dict]
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None
    sampling: SamplingParams
    n: int = 1
    continuous_usage: bool = False  # usage on every stream chunk (vLLM's extension)
    tools: list[dict] = field(default_factory=list)
    tool_choice: Any = "none"
    chat_template_kwargs: dict = field(default_factory=dict)

    @property
    def active_tools(self) -> list[dict]:
        """The tools the model is shown: none for "none", only the named one if named."""
        if self.tool_choice == "none":
            return []
        if isinstance(self.tool_choice, dict):
            name = self.tool_choice["function"]["name"]
            return [t for t in self.tools if t["function"]["name"] == name]
        return self.tools


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list):
        raise bad_request("'messages' must be an array of message objects", "messages", "invalid_type")
    if not messages:
        raise bad_request("'messages' must contain at least one message", "messages")
    for i, msg in enumerate(messages):
        _check_message(msg, f"messages[{i}]")
    return messages


def _check_message(msg: Any, where: str) -> None:
    if not isinstance(msg, dict):
        raise bad_request(f"'{where}' must be an object", where, "invalid_type")
    role = msg.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        raise bad_request(f"'{where}.role' must be one of {sorted(_ROLES)}", f"{where}.role")
    for key in ("name", "tool_call_id"):
        _get(msg, key, (str,), param=f"{where}.{key}")
    calls = msg.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise bad_request("only assistant messages carry 'tool_calls'", f"{where}.tool_calls")
        _check_tool_calls(calls, f"{where}.tool_calls")
    content = msg.get("content")
    if content is None:
        if role == "assistant":  # a turn that only called tools
            return
        raise bad_request(f"'{where}.content' is required", f"{where}.content", "missing_required_parameter")
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise bad_request(f"'{where}.content' must be a string or an array of content parts",
                          f"{where}.content", "invalid_type")
    for j, part in enumerate(content):
        _check_part(part, f"{where}.content[{j}]", role)


def _check_tool_calls(calls: Any, where: str) -> None:
    if not isinstance(calls, list):
        raise bad_request(f"'{where}' must be an array of tool calls", where, "invalid_type")
    for k, call in enumerate(calls):
        at = f"{where}[{k}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise bad_request(f"'{at}' must be {{\"type\": \"function\", \"function\": {{...}}}}", at, "invalid_type")
        _get(call, "id", (str,), param=f"{at}.id")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"'{at}.function.name' must be a non-empty string", f"{at}.function.name")
        # OpenAI sends arguments as a JSON string; an object is what templates want anyway.
        _get(fn, "arguments", (str, dict), param=f"{at}.function.arguments")


def _check_part(part: Any, where: str, role: str) -> None:
    if not isinstance(part, dict):
        raise bad_request(f"'{where}' must be an object", where, "invalid_type")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise bad_request(f"'{where}.text' must be a string", f"{where}.text", "invalid_type")
    elif kind == "image_url":
        if role != "user":
            raise bad_request("images are only supported in user messages", where)
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if not isinstance(url, str) or not url:
            raise bad_request(
                f"'{where}.image_url.url' must be a non-empty string", f"{where}.image_url.url",
                "invalid_type",
            )
        if isinstance(image, dict) and image.get("detail") not in (None, "auto", "low", "high"):
            raise bad_request(f"'{where}.image_url.detail' must be 'auto', 'low' or 'high'",
                              f"{where}.image_url.detail")
    else:
        raise bad_request(
            f"unsupported content part type {kind!r} (expected 'text' or 'image_url')",
            f"{where}.type",
        )


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 16:
        return [s for s in stop if s]
    raise bad_request("'stop' must be a string or an array of at most 16 strings", "stop")


def _logit_bias(body: dict) -> dict[int, float]:
    bias = _get(body, "logit_bias", (dict,), {})
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise bad_request("'logit_bias' values must be numbers between -100 and 100", "logit_bias")
        out[token] = float(value)
    return out


def _stop_token_ids(body: dict, vocab_size: int) -> list[int]:
    ids = _get(body, "stop_token_ids", (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ids):
        raise bad_request(f"'stop_token_ids' must be token ids in [0, {vocab_size})", "stop_token_ids")
    return ids


def sampling_from(
    body: dict, vocab_size: int, defaults: dict | None = None
) -> tuple[SamplingParams, int | None]:
    """Sampling parameters shared by chat and text completions. Fields the request leaves
    out take the model's own defaults (its ``generation_config.json``), then OpenAI's."""
    d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
         **(defaults or {})}
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, None, 1, _INT32_MAX)
    min_tokens = _int(body, "min_tokens", 0, 0, _INT32_MAX)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({min_tokens}) must not exceed '{name}' ({max_tokens})", "min_tokens")
    logprobs = _get(body, "logprobs", (bool,), False)
    top_logprobs = _int(body, "top_logprobs", 0, 0, 20)
    logit_bias = _logit_bias(body)
    for token in logit_bias:
        if not 0 <= token < vocab_size:
            raise bad_request(f"'logit_bias' token id {token} is out of range", "logit_bias")
    top_k = _int(body, "top_k", d["top_k"], -1, _INT32_MAX)
    params = SamplingParams(
        max_tokens=max_tokens or 0,
        temperature=_number(body, "temperature", d["temperature"], 0.0, 2.0),
        top_p=_number(body, "top_p", d["top_p"], 0.0, 1.0, above_lo=True),
        top_k=max(top_k, 0),  # -1 means disabled, as in vLLM
        min_p=_number(body, "min_p", d["min_p"], 0.0, 1.0),
        seed=_int(body, "seed", None, _INT64_MIN, _INT64_MAX),
        repetition_penalty=_number(body, "repetition_penalty", d["repetition_penalty"], 0.01, 10.0),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=logit_bias,
        stop=_stop(body),
        stop_token_ids=_stop_token_ids(body, vocab_size),
        ignore_eos=_get(body, "ignore_eos", (bool,), False),
        min_tokens=min_tokens,
        logprobs=logprobs or top_logprobs > 0,
        top_logprobs=top_logprobs,
    )
    return params, max_tokens


MAX_N = 16  # choices per request: each is a row of the batch


def choice_count(body: dict) -> int:
    """``n``: how many choices to generate for the prompt."""
    return _int(body, "n", 1, 1, MAX_N)


def usage_options(body: dict) -> tuple[bool, bool]:
    """``stream_options``: (a usage chunk at the end, usage on every chunk). As in vLLM,
    ``continuous_usage_stats`` takes effect only with ``include_usage``."""
    options = _get(body, "stream_options", (dict,), {})
    include = _get(options, "include_usage", (bool,), False, "stream_options.include_usage")
    continuous = _get(options, "continuous_usage_stats", (bool,), False, "stream_options.continuous_usage_stats")
    return include, include and continuous


def _response_format(body: dict) -> str | None:
    """The grammar for ``response_format`` (JSON mode or a JSON Schema), or None."""
    fmt = _get(body, "response_format", (dict,), None)
    if fmt is None:
        return None
    try:
        return json_grammar(fmt)
    except ValueError as exc:
        param = "response_format.json_schema" if fmt.get("type") == "json_schema" else "response_format.type"
        raise bad_request(str(exc), param) from exc


def _tools(body: dict) -> list[dict]:
    tools = _get(body, "tools", (list,), [])
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"'{where}.function.name' must be a non-empty string", f"{where}.function.name")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"'{where}.function.parameters' must be a JSON Schema object",
                              f"{where}.function.parameters", "invalid_type")
        _get(fn, "description", (str,), param=f"{where}.function.description")
    return tools


def _tool_choice(body: dict, tools: list[dict]):
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise bad_request("tool_choice 'required' needs 'tools'", "tool_choice")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
            "\"function\": {\"name\": ...}}", "tool_choice",
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def parse_chat_request(body: Any, vocab_size: int, defaults: dict | None = None) -> ChatRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_type")
    if "messages" not in body:
        raise bad_request("'messages' is required", "messages", "missing_required_parameter")
    messages = _check_messages(body["messages"])
    stream = _get(body, "stream", (bool,), False)
    include_usage, continuous_usage = usage_options(body)
    sampling, max_tokens = sampling_from(body, vocab_size, defaults)
    sampling.grammar = _response_format(body)
    tools = _tools(body)
    return ChatRequest(
        messages=messages,
        model=_get(body, "model", (str,), None),
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        sampling=sampling,
        n=choice_count(body),
        continuous_usage=continuous_usage,
        tools=tools,
        tool_choice=_tool_choice(body, tools),
        chat_template_kwargs=_get(body, "chat_template_kwargs", (dict,), {}),
    )
