"""Gemma 4 and FunctionGemma: calls between markers, in Gemma's own argument syntax.

    <|tool_call>call:get_weather{location:<|"|>Paris<|"|>,days:3}<tool_call|>
    <start_function_call>call:get_weather{city:<escape>Paris<escape>}<end_function_call>

A region body (see tagged.py) is one or more ``call:NAME{args}`` (also ``call:NAME(args)``,
``NAME{args}``, a bare ``call:NAME``, or a JSON call object); the wait-for-response marker
also ends a region.

A call whose start marker is missing (``call:f{...}<tool_call|>``) is recognised from
``call:`` at a word boundary: it is a call if everything up to the end marker (or the end of
the output) parses as calls. Until that is decided the text is held back, so prose that
happens to contain ``call:name{`` streams late (but comes out right).
"""

from __future__ import annotations

import re

from .calls import build_args, read_call_object
from .streaming import Step
from .tagged import HOLD, Grammar, MarkerParser, MarkerScanner, Markers
from .types import RawCall
from .values import Invalid, Reader

_NAME = re.compile(r"[\w\-]+(?:[.:/][\w\-]+)*")
_SOFT_START = re.compile(r"(?<![\w\-.:])call:")
_SOFT_HEAD = re.compile(r"call:[\w\-]+(?:[.:/][\w\-]+)*[ \t]*")
_NAME_CHAR = re.compile(r"[\w\-.:]")
_SOFT = "call:"


def _markers(start: str, end: str, quote: str, response: str) -> Markers:
    return Markers(starts=(start,), ends=(end, response), drop_after=(response,), quote=quote)


GEMMA4 = _markers("<|tool_call>", "<tool_call|>", '<|"|>', "<|tool_response>")
FUNCTION_GEMMA = _markers("<start_function_call>", "<end_function_call>", "<escape>",
                          "<start_function_response>")


class GemmaGrammar(Grammar):
    def __init__(self, names, markers: Markers):
        super().__init__(names)
        self.markers = markers
        self.end = markers.ends[0]

    def read_call(self, r: Reader) -> list[RawCall]:
        r.skip_ws()
        if r.char(r.pos) == "{":
            return [read_call_object(r, self.names, any_name=True)]
        if r.text.startswith(_SOFT, r.pos):
            r.pos += len(_SOFT)
        m = _NAME.match(r.text, r.pos)
        if not m:
            raise Invalid("no function name")
        name = self.names.canonical(m.group())
        r.pos = m.end()
        r.skip_ws()
        c = r.char(r.pos)
        if c == "":
            return [RawCall(name, {})]
        if c not in ("{", "("):
            raise Invalid("no arguments")
        r.pos += 1
        pairs = r.read_pairs("}" if c == "{" else ")", positional=True)
        return [RawCall(name, build_args(pairs, self.names.params(name)))]

    def find_soft(self, buf: str, pos: int, prev: str, final: bool) -> tuple[int, bool] | None:
        found: list[tuple[int, bool]] = []
        m = _SOFT_START.search(buf, pos)
        while m and m.start() == 0 and prev and _NAME_CHAR.match(prev):
            m = _SOFT_START.search(buf, 1)
        if m:
            found.append((m.start(), False))
        if not final:  # the end of buf may be the beginning of "call:"
            for k in range(min(len(_SOFT) - 1, len(buf) - pos), 0, -1):
                if buf.endswith(_SOFT[:k]):
                    q = len(buf) - k
                    before = buf[q - 1] if q > 0 else prev
                    if not (before and _NAME_CHAR.match(before)):
                        found.append((q, True))
                    break
        return min(found) if found else None

    def soft(self, scanner: MarkerScanner, buf: str, p: int, final: bool) -> Step | str | None:
        m = _SOFT_HEAD.match(buf, p)
        if not m or m.end() >= len(buf):
            return HOLD if not final and _could_be_head(buf[p:]) else None
        e = m.end()
        if not final and buf[e] in ".:/" and e + 1 == len(buf) and buf[e - 1] not in " \t":
            return HOLD  # the name may go on: "call:ns." -> "call:ns.f{"
        if buf[e] not in "{(" and not buf.startswith(self.end, e):
            if not final and self.end.startswith(buf[e:]):
                return HOLD
            return None
        region = scanner.region(buf, e, final)
        if region is None:
            return HOLD
        body_end, region_end = region
        calls, junk = self.region_calls(buf[p:body_end])
        if not calls or junk:
            return None
        return Step(consumed=region_end, text=buf[:p], calls=calls)


def _could_be_head(text: str) -> bool:
    """Whether more text could still make ``text`` a ``call:NAME`` head."""
    return text == _SOFT or bool(re.fullmatch(r"call:[\w\-]+(?:[.:/][\w\-]+)*[.:/]?[ \t]*", text))


def parser() -> MarkerParser:
    return MarkerParser("gemma4", GemmaGrammar, markers=GEMMA4)
