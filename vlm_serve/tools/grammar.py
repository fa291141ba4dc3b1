"""Grammars that enforce ``tool_choice`` ("required" or a named function) while decoding.

For the formats whose calls are JSON (``hermes``, ``mistral``, ``llama3_json``) the reply is
constrained to exactly one call of an allowed tool, in the format's own shape, with
``arguments`` following the tool's ``parameters`` JSON Schema; the generation ends right
after the call. Other formats (Gemma's, GLM's, Kimi's) are not JSON-shaped and stay
unconstrained: the model is then only shown the tools it may call.

    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>      hermes
    [TOOL_CALLS][{"name": "f", "arguments": {...}}]                    mistral
    {"name": "f", "parameters": {...}}                                 llama3_json

A marker that the tokenizer holds as one token (``<tool_call>`` in Qwen, ``[TOOL_CALLS]``
in Mistral) is required as that token (``<[id]>`` in llguidance's lark), so the model
writes it the way it was trained to; otherwise it is required as text.
"""

from __future__ import annotations

import json
from typing import Callable

# One conventional layout, as for response_format (engine/grammar.py).
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# format -> (text before the call, text after it, key of the arguments)
_SHAPES = {
    "hermes": ("<tool_call>\n", "\n</tool_call>", "arguments"),
    "mistral": ("[TOOL_CALLS][", "]", "arguments"),
    "llama3_json": ("", "", "parameters"),
}
_MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")

ENFORCED_FORMATS = frozenset(_SHAPES)


def enforces(fmt: str | None, tool_choice) -> bool:
    """Whether ``tool_choice`` is enforced by a grammar for this tool-call format."""
    return fmt in _SHAPES and (tool_choice == "required" or isinstance(tool_choice, dict))


def tool_call_grammar(fmt: str, tools: list[dict], marker_token: Callable[[str], int | None]) -> str:
    """The llguidance lark grammar for one call of one of ``tools`` (the request's active
    tools: all of them for "required", the named one otherwise) in format ``fmt``.
    ``marker_token(text)`` is the id of the single token ``text`` encodes to, or None.
    Raises ValueError (user-facing) if a tool's parameters cannot be compiled."""
    import llguidance

    before, after, args_key = _SHAPES[fmt]
    calls = [_call_schema(t["function"], args_key) for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {**schema, "x-guidance": _JSON_STYLE}
    start = " ".join(filter(None, [_lark_text(before, marker_token), "call", _lark_text(after, marker_token)]))
    grammar = f"%llguidance {{}}\nstart: {start}\ncall: %json {json.dumps(schema)}\n"
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"cannot enforce tool_choice with these tools' parameters: {error}")
    return grammar


def _call_schema(fn: dict, args_key: str) -> dict:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def _lark_text(text: str, marker_token) -> str:
    """``text`` as a sequence of lark items: markers that are single tokens by id,
    everything else as string literals."""
    items, rest = [], text
    while rest:
        hits = [(rest.find(m), m) for m in _MARKERS if m in rest]
        if not hits:
            items.append(json.dumps(rest))
            break
        at, marker = min(hits)
        if at:
            items.append(json.dumps(rest[:at]))
        token = marker_token(marker)
        items.append(f"<[{token}]>" if token is not None else json.dumps(marker))
        rest = rest[at + len(marker):]
    return " ".join(items)
