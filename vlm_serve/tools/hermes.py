"""Hermes style (Qwen2.5-VL, Qwen3-VL, many fine-tunes): JSON calls between tags.

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A region may hold several calls or a ``[...]`` list of them; the JSON may be lenient (single
quotes, trailing commas, Python literals) and ``arguments`` may be a JSON string.
"""

from __future__ import annotations

from .calls import read_json_calls
from .tagged import Grammar, MarkerParser, Markers
from .types import RawCall
from .values import Reader


class HermesGrammar(Grammar):
    markers = Markers(starts=("<tool_call>",), ends=("</tool_call>",))

    def read_call(self, r: Reader) -> list[RawCall]:
        return read_json_calls(r, self.names)


def parser() -> MarkerParser:
    return MarkerParser("hermes", HermesGrammar)
