"""Tool-call parsers: model output text -> OpenAI ``content`` + ``tool_calls``.

    parser = get_parser(detect_parser(chat_template, model_type))
    out = parser.parse(text, tool_names)              # ParsedOutput(content, tool_calls)

    stream = parser.streaming(tool_names)             # one per request
    for chunk in decoded_chunks:
        for event in stream.feed(chunk): ...          # ContentDelta | ToolCallDelta
    for event in stream.finish(): ...

``tool_names`` is optional: the request's declared function names (a set), or a mapping name
-> parameter names (``tool_signatures(request.tools)``), which also names positional
arguments. Streaming and non-streaming give the same content and calls for any chunking.
"""

from __future__ import annotations

from . import function_gemma, gemma3, gemma4, glm4, hermes, kimi_k2, llama3, mistral
from .calls import ToolNames, tool_signatures
from .streaming import StreamingToolParser, collect
from .types import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    new_call_id,
)

__all__ = [
    "FORMATS", "ContentDelta", "ParsedOutput", "StreamEvent", "StreamingToolParser", "ToolCall",
    "ToolCallDelta", "ToolCallParser", "ToolNames", "collect", "detect_parser", "get_parser",
    "new_call_id", "tool_signatures",
]

_FACTORIES = {
    "gemma4": gemma4.parser,
    "function_gemma": function_gemma.parser,
    "gemma3": gemma3.parser,
    "hermes": hermes.parser,
    "mistral": mistral.parser,
    "llama3_json": llama3.parser,
    "glm4": glm4.parser,
    "kimi_k2": kimi_k2.parser,
}
FORMATS = tuple(_FACTORIES)

# First match wins: GLM's and Hermes's templates both have <tool_call>.
_TEMPLATE_MARKERS = (
    ("gemma4", ("<|tool_call>",)),
    ("function_gemma", ("<start_function_call>",)),
    ("kimi_k2", ("<|tool_calls_section_begin|>", "<|tool_call_begin|>")),
    ("glm4", ("<arg_key>",)),
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|python_tag|>", '"parameters": dictionary of argument name')),
)


def get_parser(name: str) -> ToolCallParser:
    """The parser for a format, one of :data:`FORMATS`."""
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r}; known: {', '.join(FORMATS)}") from None


def detect_parser(chat_template: str | None, model_type: str | None) -> str | None:
    """The format a model writes calls in, from its chat template's markers, else (Gemma)
    its model type; None when no tool-call format is known for it."""
    template = chat_template or ""
    for fmt, markers in _TEMPLATE_MARKERS:
        if any(m in template for m in markers):
            return fmt
    kind = (model_type or "").lower()
    if kind.startswith("gemma4"):
        return "gemma4"
    if kind.startswith("gemma3") or "tool_code" in template:
        return "gemma3"
    return None
