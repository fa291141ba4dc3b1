"""FunctionGemma: ``<start_function_call>call:name{city:<escape>Paris<escape>}<end_function_call>``
(the grammar is Gemma 4's, see gemma4.py)."""

from .gemma4 import FUNCTION_GEMMA, GemmaGrammar
from .tagged import MarkerParser


def parser() -> MarkerParser:
    return MarkerParser("function_gemma", GemmaGrammar, markers=FUNCTION_GEMMA)
