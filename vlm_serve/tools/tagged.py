"""Formats that wrap calls in start/end markers: Gemma 4 and FunctionGemma.

    <|tool_call>call:get_weather{location:<|"|>Paris<|"|>,days:3}<tool_call|>

A *region* runs from the start marker to the end marker, or else to the next start marker,
the model's wait-for-response marker, or the end of the output. Its body is one or more
``call:NAME{args}`` (also ``call:NAME(args)``, ``NAME{args}``, a bare ``call:NAME``, or a
JSON call object). A body that does not parse stays content, markers and all; text after
the calls in a region stays content too.

A call whose start marker is missing (``call:f{...}<tool_call|>``) is recognised from
``call:`` at a word boundary: it is a call if everything up to the end marker (or the end of
the output) parses as calls. Until that is decided the text is held back, so prose that
happens to contain ``call:name{`` streams late (but comes out right).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .calls import ToolNames, ToolNamesSpec, build_args, read_call_object
from .streaming import Step, StreamingToolParser, hold, parse_all
from .types import ParsedOutput, RawCall
from .values import Invalid, Reader

_NAME = re.compile(r"[\w\-]+(?:[.:/][\w\-]+)*")
_SOFT_START = re.compile(r"(?<![\w\-.:])call:")
_SOFT_HEAD = re.compile(r"call:[\w\-]+(?:[.:/][\w\-]+)*[ \t]*")
_NAME_CHAR = re.compile(r"[\w\-.:]")
_JUNK_OK = re.compile(r"[\s)\]},;]*")  # stray closers after the calls are dropped
_SOFT = "call:"


@dataclass(frozen=True)
class TaggedFormat:
    start: str  # opens a call
    end: str  # closes it
    quote: str  # the string delimiter inside arguments
    response: str  # what the model emits after a call to wait for the result


class TaggedScanner:
    def __init__(self, fmt: TaggedFormat, names: ToolNames):
        self.fmt = fmt
        self.names = names
        self._after_end = False

    def scan(self, buf: str, prev: str, final: bool) -> Step | None:
        if self._after_end:  # drop a wait-for-response marker right after a call
            if buf.startswith(self.fmt.response):
                self._after_end = False
                return Step(consumed=len(self.fmt.response))
            if not final and self.fmt.response.startswith(buf):
                return None
            self._after_end = False
        pos = 0
        while True:
            found = self._next(buf, pos, prev, final)
            if found is None:
                return Step(consumed=len(buf), text=buf)
            p, kind = found
            if kind == "partial":
                return hold(buf, p)
            region = self._hard(buf, p, final) if kind == "start" else self._soft(buf, p, final)
            if region == "hold":
                return hold(buf, p)
            if region is None:  # "call:" that is not a call
                pos = p + 1
                continue
            return region

    def _next(self, buf: str, pos: int, prev: str, final: bool) -> tuple[int, str] | None:
        """The first place at or after ``pos`` where a call may start."""
        found: list[tuple[int, str]] = []
        start = buf.find(self.fmt.start, pos)
        if start >= 0:
            found.append((start, "start"))
        m = _SOFT_START.search(buf, pos)
        while m and m.start() == 0 and prev and _NAME_CHAR.match(prev):
            m = _SOFT_START.search(buf, 1)
        if m:
            found.append((m.start(), "soft"))
        if not final:
            partial = self._partial(buf, pos, prev)
            if partial is not None:
                found.append((partial, "partial"))
        return min(found) if found else None

    def _partial(self, buf: str, pos: int, prev: str) -> int | None:
        """Where the end of ``buf`` may be the beginning of a marker or of ``call:``."""
        best = None
        for marker in (self.fmt.start, _SOFT):
            for k in range(min(len(marker) - 1, len(buf) - pos), 0, -1):
                if buf.endswith(marker[:k]):
                    q = len(buf) - k
                    before = buf[q - 1] if q > 0 else prev
                    if marker is _SOFT and before and _NAME_CHAR.match(before):
                        continue
                    best = q if best is None else min(best, q)
                    break
        return best

    def _region(self, buf: str, body_start: int, final: bool) -> tuple[int, int] | None:
        """(end of body, end of region) from ``body_start``; None: not decided yet.
        The region ends at (and takes) the end marker or the wait-for-response marker, or
        ends before the next start marker, or at the end of the output."""
        fmt = self.fmt
        ends = [(i, i + len(m)) for m, i in ((fmt.end, buf.find(fmt.end, body_start)),
                                             (fmt.response, buf.find(fmt.response, body_start)),
                                             ("", buf.find(fmt.start, body_start))) if i >= 0]
        if not ends:
            return None if not final else (len(buf), len(buf))
        return min(ends)

    def _hard(self, buf: str, p: int, final: bool) -> Step | str:
        region = self._region(buf, p + len(self.fmt.start), final)
        if region is None:
            return "hold"
        body_end, region_end = region
        calls, junk = self._calls(buf[p + len(self.fmt.start):body_end])
        if not calls:  # not a call after all: keep every character
            return Step(consumed=region_end, text=buf[:region_end])
        self._after_end = buf.startswith(self.fmt.end, body_end)
        return Step(consumed=region_end, text=buf[:p], calls=calls, after=junk)

    def _soft(self, buf: str, p: int, final: bool) -> Step | str | None:
        m = _SOFT_HEAD.match(buf, p)
        if not m or m.end() >= len(buf):
            return "hold" if not final and _could_be_head(buf[p:]) else None
        e = m.end()
        if not final and buf[e] in ".:/" and e + 1 == len(buf) and buf[e - 1] not in " \t":
            return "hold"  # the name may go on: "call:ns." -> "call:ns.f{"
        if buf[e] not in "{(" and not buf.startswith(self.fmt.end, e):
            if not final and self.fmt.end.startswith(buf[e:]):
                return "hold"
            return None
        region = self._region(buf, e, final)
        if region is None:
            return "hold"
        body_end, region_end = region
        calls, junk = self._calls(buf[p:body_end])
        if not calls or junk:
            return None
        self._after_end = buf.startswith(self.fmt.end, body_end)
        return Step(consumed=region_end, text=buf[:p], calls=calls)

    def _calls(self, body: str) -> tuple[list[RawCall], str]:
        """The calls a region body holds, and the text after them that is not a call."""
        reader = Reader(body, eof=True, raw_quote=self.fmt.quote)
        calls: list[RawCall] = []
        while True:
            while reader.pos < len(body) and body[reader.pos] in " \t\r\n,;":
                reader.pos += 1
            if reader.pos >= len(body):
                return calls, ""
            start = reader.pos
            try:
                calls.append(self._call(reader))
            except Invalid:
                junk = body[start:]
                return calls, "" if calls and _JUNK_OK.fullmatch(junk) else junk

    def _call(self, reader: Reader) -> RawCall:
        reader.skip_ws()
        if reader.char(reader.pos) == "{":
            return read_call_object(reader, self.names, any_name=True)
        if reader.text.startswith(_SOFT, reader.pos):
            reader.pos += len(_SOFT)
        m = _NAME.match(reader.text, reader.pos)
        if not m:
            raise Invalid("no function name")
        name = self.names.canonical(m.group())
        reader.pos = m.end()
        reader.skip_ws()
        c = reader.char(reader.pos)
        if c == "":
            return RawCall(name, {})
        if c not in ("{", "("):
            raise Invalid("no arguments")
        reader.pos += 1
        pairs = reader.read_pairs("}" if c == "{" else ")", positional=True)
        return RawCall(name, build_args(pairs, self.names.params(name)))


def _could_be_head(text: str) -> bool:
    """Whether more text could still make ``text`` a ``call:NAME`` head."""
    return text == _SOFT or bool(re.fullmatch(r"call:[\w\-]+(?:[.:/][\w\-]+)*[.:/]?[ \t]*", text))


class TaggedParser:
    """A :class:`ToolCallParser` for one tagged format."""

    def __init__(self, name: str, fmt: TaggedFormat):
        self.name = name
        self.format = fmt

    def streaming(self, tool_names: ToolNamesSpec = None) -> StreamingToolParser:
        return StreamingToolParser(TaggedScanner(self.format, ToolNames(tool_names)))

    def parse(self, text: str, tool_names: ToolNamesSpec = None) -> ParsedOutput:
        return parse_all(self.streaming(tool_names), text)
