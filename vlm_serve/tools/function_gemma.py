"""FunctionGemma: ``<start_function_call>call:name{city:<escape>Paris<escape>}<end_function_call>``."""

from .tagged import TaggedFormat, TaggedParser

FUNCTION_GEMMA = TaggedFormat(
    start="<start_function_call>",
    end="<end_function_call>",
    quote="<escape>",
    response="<start_function_response>",
)


def parser() -> TaggedParser:
    return TaggedParser("function_gemma", FUNCTION_GEMMA)
