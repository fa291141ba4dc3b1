"""Mistral / Pixtral: calls after ``[TOOL_CALLS]``, with no end marker.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]     (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                            (v11+ tokenizers)
    [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}

The calls end where their JSON does; each one streams as soon as it is complete. Text after
them stays content; ``[TOOL_CALLS]`` followed by something else stays content, marker and all.
"""

from __future__ import annotations

import re

from .calls import read_arguments, read_json_calls
from .tagged import Grammar, MarkerParser, Markers
from .types import RawCall
from .values import Invalid, Reader

_NAME = re.compile(r"[\w\-]+(?:\.[\w\-]+)*")
_CALL_ID = re.compile(r"[\w\-]*")


class MistralGrammar(Grammar):
    markers = Markers(starts=("[TOOL_CALLS]",))

    def read_call(self, r: Reader) -> list[RawCall]:
        c = r.next_char()
        if c in "{[":
            return read_json_calls(r, self.names)
        m = _NAME.match(r.text, r.pos)
        if not m:
            raise Invalid("no function name")
        if r.char(m.end()) == ".":  # Incomplete while the name may go on
            r.char(m.end() + 1)
        r.pos = m.end()
        if r.starts("[CALL_ID]"):
            r.pos = _CALL_ID.match(r.text, r.pos + len("[CALL_ID]")).end()
            r.char(r.pos)  # Incomplete while the id may go on
        if not r.starts("[ARGS]"):
            raise Invalid("no [ARGS]")
        r.pos += len("[ARGS]")
        return [RawCall(self.names.canonical(m.group()), read_arguments(r))]


def parser() -> MarkerParser:
    return MarkerParser("mistral", MistralGrammar)
