"""Grammars that enforce ``tool_choice`` ("required" or a named function) while decoding.

The reply is constrained to exactly one call of an allowed tool, in the model's own
tool-call format, and the generation ends right after it:

    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>           hermes
    [TOOL_CALLS][{"name": "f", "arguments": {...}}]                         mistral
    {"name": "f", "parameters": {...}}                                      llama3_json
    <|tool_call>call:f{city:<|"|>Paris<|"|>,days:3}<tool_call|>            gemma4
    <start_function_call>call:f{city:<escape>Paris<escape>}<end_function_call>
                                                                            function_gemma
    ```tool_code\\nf(city="Paris", days=3)\\n```                            gemma3
    <tool_call>f\\n<arg_key>city</arg_key>\\n<arg_value>Paris</arg_value>\\n</tool_call>
                                                                            glm4
    <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>
    {...}<|tool_call_end|><|tool_calls_section_end|>                        kimi_k2

Where the format writes values as JSON they follow the tool's ``parameters`` schema
(``%json``); Gemma's own syntax follows it through gemma_grammar.py; GLM's raw string values
keep the schema's length bounds and enums. Argument names are the schema's properties, the
required ones always, in a fixed order. Every shape is one the format's parser reads back.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from .gemma_grammar import GemmaValues
from .lark import Lark

MarkerToken = Callable[[str], "int | None"]

# format -> (text before the call, text after it, key of the arguments)
_JSON_SHAPES = {
    "hermes": ("<tool_call>\n", "\n</tool_call>", "arguments"),
    "mistral": ("[TOOL_CALLS][", "]", "arguments"),
    "llama3_json": ("", "", "parameters"),
}
# format -> (call start, call end, string quote, wait-for-response marker)
_GEMMA = {
    "gemma4": ("<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>"),
    "function_gemma": ("<start_function_call>", "<end_function_call>", "<escape>", "<start_function_response>"),
}
_GLM = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
_KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
         "<|tool_call_end|>", "<|tool_calls_section_end|>")

# The function names each format's parser reads back as written.
_WORDS = r"[\w\-]+(?:[.:/][\w\-]+)*"
_NAMES = {
    "gemma4": re.compile(_WORDS),
    "function_gemma": re.compile(_WORDS),
    "gemma3": re.compile(r"[A-Za-z_][\w\-]*(?:[.:][A-Za-z_][\w\-]*)*"),
    "glm4": re.compile(_WORDS),
    "kimi_k2": re.compile(r"(?!functions\.)[\w\-]+(?:[./][\w\-]+)*"),  # ":N" is the call's index
}
_BARE_KEY = re.compile(r"[\w\-.$@]+")  # an argument name read without quotes

ENFORCED_FORMATS = frozenset(_JSON_SHAPES) | frozenset(_GEMMA) | {"gemma3", "glm4", "kimi_k2"}


def enforces(fmt: str | None, tool_choice) -> bool:
    """Whether ``tool_choice`` is enforced by a grammar for this tool-call format."""
    return fmt in ENFORCED_FORMATS and (tool_choice == "required" or isinstance(tool_choice, dict))


def tool_call_grammar(fmt: str, tools: list[dict], marker_token: MarkerToken) -> str:
    """The llguidance lark grammar for one call of one of ``tools`` (the request's active
    tools: all of them for "required", the named one otherwise) in format ``fmt``.
    ``marker_token(text)`` is the id of the single token ``text`` encodes to, or None.
    Raises ValueError (user-facing) if a tool cannot be enforced in this format."""
    functions = [t["function"] for t in tools]
    names = _NAMES.get(fmt)
    for fn in functions:
        if names is not None and not names.fullmatch(fn["name"]):
            raise ValueError(f"cannot enforce tool_choice: the {fmt} tool-call format cannot write the "
                             f"function name {fn['name']!r}")
    if fmt in _JSON_SHAPES:
        return _json_calls(fmt, functions, marker_token)
    if fmt in _GEMMA:
        return _gemma_calls(fmt, functions, marker_token)
    return {"gemma3": _gemma3_calls, "glm4": _glm4_calls, "kimi_k2": _kimi_calls}[fmt](functions, marker_token)


def _parameters(fn: dict) -> dict:
    params = fn.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object", "properties": {}}


def _defs(schema: dict) -> dict:
    """The schema's definitions, to go along with any part of it compiled on its own."""
    return {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema.get(k), dict)}


def _properties(params: dict) -> tuple[dict | None, set]:
    """Declared properties (the only argument names; None: free-form) and the required ones."""
    props = params.get("properties")
    return (props if isinstance(props, dict) else None), set(params.get("required") or ())


def _json_calls(fmt: str, functions: list[dict], marker_token: MarkerToken) -> str:
    before, after, args_key = _JSON_SHAPES[fmt]
    lark = Lark(marker_token, ("<tool_call>", "</tool_call>", "[TOOL_CALLS]"))
    calls, defs = [], {}
    for fn in functions:
        params = _parameters(fn)
        defs.update(_defs(params))  # refs are written against the parameters' root
        calls.append({
            "type": "object",
            "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key],
            "additionalProperties": False,
        })
    lark.defs = defs
    call = lark.json(calls[0] if len(calls) == 1 else {"anyOf": calls})
    return lark.grammar(" ".join(filter(None, [lark.text(before), call, lark.text(after)])))


def _gemma_calls(fmt: str, functions: list[dict], marker_token: MarkerToken) -> str:
    start, end, quote, response = _GEMMA[fmt]
    markers = (start, end, quote, response)
    lark = Lark(marker_token, markers)
    calls = []
    for fn in functions:
        params = _parameters(fn)
        lark.defs = _defs(params)
        args = GemmaValues(lark, quote, markers, params).arguments(params)
        calls.append(lark.rule(f"{lark.text(start + 'call:' + fn['name'])} {args} {lark.text(end)}"))
    return lark.grammar(" | ".join(calls))


def _gemma3_calls(functions: list[dict], marker_token: MarkerToken) -> str:
    """Python keyword arguments with JSON values (as Gemma 3's tool prompt shows them)."""
    lark = Lark(marker_token)
    calls = []
    for fn in functions:
        params = _parameters(fn)
        lark.defs = _defs(params)
        props, required = _properties(params)
        if props is not None:
            items = [(f'{_key(k)} "=" {lark.json(s)}', k in required) for k, s in props.items()]
            args = lark.fields(items, '", "')
        else:
            pair = f'/[A-Za-z_][A-Za-z0-9_]*/ "=" {lark.json({})}'
            args = f'({pair} (", " {pair})*)?'
        head, tail = lark.text("```tool_code\n" + fn["name"] + "("), lark.text(")\n```")
        calls.append(lark.rule(" ".join(filter(None, [head, args, tail]))))
    return lark.grammar(" | ".join(calls))


def _glm4_calls(functions: list[dict], marker_token: MarkerToken) -> str:
    """Key/value tags; a string parameter's value is its raw text, any other is JSON (what
    the parser reads a declared string parameter as)."""
    lark = Lark(marker_token, _GLM)
    calls = []
    for fn in functions:
        params = _parameters(fn)
        lark.defs = _defs(params)
        props, required = _properties(params)
        if props is not None:
            items = [(lark.text("\n<arg_key>" + k + "</arg_key>\n") + " " + _glm4_value(lark, s), k in required)
                     for k, s in props.items()]
            args = lark.fields(items, "")
        else:
            key = lark.delimited("<arg_key>", "</arg_key>", _GLM)
            value = lark.delimited("<arg_value>", "</arg_value>", _GLM)
            args = f'("\\n" {key} "\\n" {value})*'
        head, tail = lark.text("<tool_call>" + fn["name"]), lark.text("\n</tool_call>")
        calls.append(lark.rule(" ".join(filter(None, [head, args, tail]))))
    return lark.grammar(" | ".join(calls))


def _glm4_value(lark: Lark, schema) -> str:
    schema = schema if isinstance(schema, dict) else {}
    kind = schema.get("type")
    if not (kind == "string" or (isinstance(kind, list) and "string" in kind)):
        return f'{lark.text("<arg_value>")} {lark.json(schema)} {lark.text("</arg_value>")}'
    enum = [v for v in schema.get("enum") or () if isinstance(v, str)]
    if enum:
        return "(" + " | ".join(lark.text(f"<arg_value>{v}</arg_value>") for v in enum) + ")"
    low, high = schema.get("minLength"), schema.get("maxLength")
    return lark.delimited("<arg_value>", "</arg_value>", _GLM, low if isinstance(low, int) and low > 0 else 0,
                          high if isinstance(high, int) and high >= 0 else None)


def _kimi_calls(functions: list[dict], marker_token: MarkerToken) -> str:
    section, begin, arguments, end, section_end = _KIMI
    lark = Lark(marker_token, _KIMI)
    calls = []
    for fn in functions:
        params = _parameters(fn)
        lark.defs = _defs(params)
        head = lark.text(f"{section}{begin}functions.{fn['name']}:0{arguments}")
        calls.append(lark.rule(f"{head} {lark.json(params)} {lark.text(end + section_end)}"))
    return lark.grammar(" | ".join(calls))


def _key(key: str) -> str:
    """A Python-style argument name: bare when it reads back bare, else quoted."""
    return json.dumps(key if _BARE_KEY.fullmatch(key) else json.dumps(key))
