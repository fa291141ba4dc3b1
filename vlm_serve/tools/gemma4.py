"""Gemma 4: ``<|tool_call>call:get_weather{location:<|"|>Paris<|"|>,days:3}<tool_call|>``."""

from .tagged import TaggedFormat, TaggedParser

GEMMA4 = TaggedFormat(
    start="<|tool_call>",
    end="<tool_call|>",
    quote='<|"|>',
    response="<|tool_response>",
)


def parser() -> TaggedParser:
    return TaggedParser("gemma4", GEMMA4)
