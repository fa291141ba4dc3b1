"""Kimi K2: a section of calls, each a numbered function id and JSON arguments.

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

The section is the region (see tagged.py); ``functions.`` and the ``:0`` index are not part
of the name. The singular ``<|tool_call_section_begin|>`` spelling is accepted too.
"""

from __future__ import annotations

import re

from .calls import read_arguments
from .tagged import Grammar, MarkerParser, Markers
from .types import RawCall
from .values import Invalid, Reader

_BEGIN, _ARGS, _END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
_ID = re.compile(r"\s*(?:functions\.)?([\w\-]+(?:[.:/][\w\-]+)*?)(?::\d+)?\s*")


class KimiK2Grammar(Grammar):
    markers = Markers(starts=("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"),
                      ends=("<|tool_calls_section_end|>", "<|tool_call_section_end|>"))

    def read_call(self, r: Reader) -> list[RawCall]:
        if not r.starts(_BEGIN):
            raise Invalid(f"no {_BEGIN}")
        start = r.pos + len(_BEGIN)
        head = r.text.find(_ARGS, start)
        m = _ID.fullmatch(r.text, start, head) if head >= 0 else None
        if not m:
            raise Invalid("no function id")
        r.pos = head + len(_ARGS)
        args = read_arguments(r)
        r.skip_ws()
        if r.starts(_END):
            r.pos += len(_END)
        elif r.pos < len(r.text) and not r.starts(_BEGIN):
            raise Invalid(f"no {_END}")
        return [RawCall(self.names.canonical(m.group(1)), args)]


def parser() -> MarkerParser:
    return MarkerParser("kimi_k2", KimiK2Grammar)
