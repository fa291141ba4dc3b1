"""Llama 3.x JSON tool calls: a JSON object, optionally after ``<|python_tag|>``.

    {"name": "get_weather", "parameters": {"city": "Paris"}}
    <|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}

A call object (``parameters`` or ``arguments``), or a ``[...]`` list of them, is a call
wherever it starts; ``;`` right after a call is dropped. Any other JSON stays content: the
first key that is not a call's gives it away, so ordinary JSON streams without delay.
"""

from __future__ import annotations

import re

from .calls import read_json_calls
from .streaming import Step
from .tagged import Grammar, MarkerParser, MarkerScanner, Markers
from .types import RawCall
from .values import Reader

_SOFT = re.compile(r"[{\[]")


class Llama3Grammar(Grammar):
    markers = Markers(starts=("<|python_tag|>",), drop_after=(";",))

    def read_call(self, r: Reader) -> list[RawCall]:
        r.next_char()
        return read_json_calls(r, self.names)

    def find_soft(self, buf: str, pos: int, prev: str, final: bool) -> tuple[int, bool] | None:
        m = _SOFT.search(buf, pos)
        return (m.start(), False) if m else None

    def soft(self, scanner: MarkerScanner, buf: str, p: int, final: bool) -> Step | str | None:
        return scanner.read_open(buf, p, p, final)


def parser() -> MarkerParser:
    return MarkerParser("llama3_json", Llama3Grammar)
