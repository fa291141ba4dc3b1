"""GLM-4.5 / 4.6 / GLM-4.5V: a name and key/value tags between ``<tool_call>`` tags.

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

Values are written raw: a parameter the request declares as a string keeps its text as
written; any other value is read as JSON (or leniently: ``True``, single quotes), else kept
as text without the whitespace around it.
A region body may also be ``name\\n{json}`` or a JSON call object. GLM-4's older form,
``name\\n{json}`` with no tags, is a call when it opens the output.
(GLM-4.1V's template has no tools.)
"""

from __future__ import annotations

import json
import re
from typing import Any

from .calls import read_arguments, read_json_calls
from .streaming import Step
from .tagged import Grammar, MarkerParser, MarkerScanner, Markers
from .types import RawCall
from .values import Incomplete, Invalid, Reader, classify

_NAME = re.compile(r"[\w\-]+(?:[.:/][\w\-]+)*")
_HEAD = re.compile(r"[^\n<{]*")
_LEGACY = re.compile(r"([\w\-]+(?:\.[\w\-]+)*)\n\{")
_LEGACY_PREFIX = re.compile(r"[\w\-.]*\n?")
_KEY, _KEY_END, _VALUE, _VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class Glm4Grammar(Grammar):
    markers = Markers(starts=("<tool_call>",), ends=("</tool_call>",))

    def region_calls(self, body: str) -> tuple[list[RawCall], str]:
        """One call per region (a JSON list may hold several)."""
        r = Reader(body, eof=True)
        try:
            calls = self.read_call(r)
        except Invalid:
            return [], body
        rest = body[r.pos:]
        return calls, "" if not rest.strip() else rest

    def read_call(self, r: Reader) -> list[RawCall]:
        r.skip_ws()
        if r.char(r.pos) in ("{", "["):
            return read_json_calls(r, self.names)
        head = _HEAD.match(r.text, r.pos)
        name = head.group().strip()
        if not _NAME.fullmatch(name):
            raise Invalid("no function name")
        name = self.names.canonical(name)
        r.pos = head.end()
        r.skip_ws()
        if r.char(r.pos) == "{":
            return [RawCall(name, read_arguments(r))]
        args: dict[str, Any] = {}
        while r.starts(_KEY):
            key, r.pos = _between(r.text, r.pos + len(_KEY), _KEY_END)
            r.skip_ws()
            if not r.starts(_VALUE):
                raise Invalid("<arg_key> without <arg_value>")
            value, r.pos = _between(r.text, r.pos + len(_VALUE), _VALUE_END)
            args[key.strip()] = self._value(name, key.strip(), value)
            r.skip_ws()
        return [RawCall(name, args)]

    def _value(self, name: str, key: str, text: str) -> Any:
        if self.names.is_string(name, key):
            return text
        text = text.strip()
        try:
            return json.loads(text)
        except ValueError:
            pass
        if text[:1] in ("{", "["):
            r = Reader(text, 1, eof=True)
            try:
                value = dict(r.read_pairs("}", positional=False)) if text[0] == "{" else r.read_list("]")
                if r.pos == len(text):
                    return value
            except Invalid:
                pass
        return classify(text)

    # GLM-4's older form: ``name\n{json}`` at the start of the output.
    def find_soft(self, buf: str, pos: int, prev: str, final: bool) -> tuple[int, bool] | None:
        if pos or prev:
            return None
        if _LEGACY.match(buf):
            return 0, False
        return (0, True) if not final and _LEGACY_PREFIX.fullmatch(buf) else None

    def soft(self, scanner: MarkerScanner, buf: str, p: int, final: bool) -> Step | str | None:
        m = _LEGACY.match(buf)
        if self.names.declared is not None and self.names.resolve(m.group(1)) is None:
            return None
        r = Reader(buf, m.end() - 1, eof=final)
        try:
            args = read_arguments(r)
        except Incomplete:
            return scanner.wait_open()
        except Invalid:
            return None
        return Step(consumed=r.pos, calls=[RawCall(self.names.canonical(m.group(1)), args)])


def _between(text: str, start: int, end_tag: str) -> tuple[str, int]:
    end = text.find(end_tag, start)
    if end < 0:
        raise Invalid(f"no {end_tag}")
    return text[start:end], end + len(end_tag)


def parser() -> MarkerParser:
    return MarkerParser("glm4", Glm4Grammar)
