"""The scanner every marker-led format shares: calls follow a start marker.

Two shapes of format (a :class:`Markers` with or without ``ends``):

* *Regions* (Gemma 4, FunctionGemma, Hermes, GLM-4, Kimi K2): a region runs from a start
  marker to an end marker, or else to the next start marker or the end of the output. Its
  body is parsed whole; a body without a call stays content, markers and all, and text in
  a region after its calls stays content too.
* *Open* (Mistral ``[TOOL_CALLS]``, Llama 3 ``<|python_tag|>``): no end marker; the calls
  end where their syntax does, read as the text comes (values.py's prefix-monotone reader).

A :class:`Grammar` says what a call looks like; it may also recognise calls that come
without a start marker (*soft* starts: Gemma's ``call:f{...}``, Llama's bare JSON).
Markers in ``drop_after`` right after a call are dropped (a wait-for-response marker).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .calls import ToolNames, ToolNamesSpec
from .streaming import Step, StreamingToolParser, hold, parse_all
from .types import ParsedOutput, RawCall
from .values import Incomplete, Invalid, Reader

HOLD = "hold"
_JUNK_OK = re.compile(r"[\s)\]},;]*")  # stray closers after the calls are dropped
SEPARATORS = " \t\r\n,;"


@dataclass(frozen=True)
class Markers:
    starts: tuple[str, ...]  # open calls
    ends: tuple[str, ...] = ()  # close a region; () : an open format
    drop_after: tuple[str, ...] = ()  # dropped right after a call
    quote: str | None = None  # the format's verbatim string delimiter, if any


class Grammar:
    """What calls look like in one format. Override ``read_call`` (and the soft hooks)."""

    markers: Markers

    def __init__(self, names: ToolNames):
        self.names = names

    def read_call(self, r: Reader) -> list[RawCall]:
        """The call(s) at ``r.pos``; Invalid if there are none (Incomplete: wait)."""
        raise NotImplementedError

    def region_calls(self, body: str) -> tuple[list[RawCall], str]:
        """The calls a region body holds, and the text after them that is not a call."""
        r = Reader(body, eof=True, raw_quote=self.markers.quote)
        calls: list[RawCall] = []
        while True:
            while r.pos < len(body) and body[r.pos] in SEPARATORS:
                r.pos += 1
            if r.pos >= len(body):
                return calls, ""
            start = r.pos
            try:
                calls += self.read_call(r)
            except Invalid:
                junk = body[start:]
                return calls, "" if calls and _JUNK_OK.fullmatch(junk) else junk

    def find_soft(self, buf: str, pos: int, prev: str, final: bool) -> tuple[int, bool] | None:
        """Where a call without a start marker may begin at or after ``pos``, and whether
        the text there is too short to tell; None: nowhere."""
        return None

    def soft(self, scanner: MarkerScanner, buf: str, p: int, final: bool) -> Step | str | None:
        """The call(s) starting at ``p`` (a :class:`Step`), HOLD, or None: not a call."""
        return None


class MarkerScanner:
    def __init__(self, grammar: Grammar):
        self.g = grammar
        self.m = grammar.markers
        self._after_call = False
        self.rescan_growth = 1.0

    def scan(self, buf: str, prev: str, final: bool) -> Step | None:
        self.rescan_growth = 1.0
        if self._after_call:
            self._after_call = False
            for marker in self.m.drop_after:
                if buf.startswith(marker):
                    return Step(consumed=len(marker))
                if not final and marker.startswith(buf):
                    self._after_call = True
                    return None
        pos = 0
        while True:
            found = self._next(buf, pos, prev, final)
            if found is None:
                return Step(consumed=len(buf), text=buf)
            p, marker = found
            if marker is None:  # the end of buf may begin a call
                return hold(buf, p)
            step = self._hard(buf, p, marker, final) if marker else self.g.soft(self, buf, p, final)
            if step == HOLD:
                return hold(buf, p)
            if step is None:  # not a call after all
                pos = p + 1
                continue
            assert isinstance(step, Step)
            self._after_call = bool(step.calls)
            return step

    def _next(self, buf: str, pos: int, prev: str, final: bool) -> tuple[int, str | None] | None:
        """(where a call may start, its start marker; "" for a soft start, None when the
        text there is too short to tell)."""
        found: list[tuple[int, int, str | None]] = []
        for marker in self.m.starts:
            i = buf.find(marker, pos)
            if i >= 0:
                found.append((i, 0, marker))
            elif not final:
                q = partial_at_end(buf, pos, marker)
                if q is not None:
                    found.append((q, 2, None))
        soft = self.g.find_soft(buf, pos, prev, final)
        if soft is not None:
            found.append((soft[0], 1, None if soft[1] else ""))
        if not found:
            return None
        p, _, marker = min(found)
        return p, marker

    def region(self, buf: str, body_start: int, final: bool) -> tuple[int, int] | None:
        """(end of body, end of region) from ``body_start``; None: not decided yet.
        A region ends at (and takes) an end marker, or ends before the next start marker,
        or at the end of the output."""
        ends = [(i, i + len(m)) for m in self.m.ends if (i := buf.find(m, body_start)) >= 0]
        ends += [(i, i) for m in self.m.starts if (i := buf.find(m, body_start)) >= 0]
        if not ends:
            return (len(buf), len(buf)) if final else None
        return min(ends)

    def read_open(self, buf: str, p: int, body_start: int, final: bool) -> Step | str | None:
        """Calls that end themselves, read from ``body_start`` (the call starts at ``p``)."""
        r = Reader(buf, body_start, eof=final, raw_quote=self.m.quote)
        try:
            calls = self.g.read_call(r)
        except Incomplete:
            return self.wait_open()
        except Invalid:
            return None
        return Step(consumed=r.pos, text=buf[:p], calls=calls)

    def wait_open(self) -> str:
        """HOLD for a call that has no end marker: it is only seen to end by parsing it,
        so a long one is parsed again only after it grew by an eighth."""
        self.rescan_growth = 1.125
        return HOLD

    def _hard(self, buf: str, p: int, marker: str, final: bool) -> Step | str | None:
        body_start = p + len(marker)
        if not self.m.ends:
            return self.read_open(buf, p, body_start, final)
        region = self.region(buf, body_start, final)
        if region is None:
            return HOLD
        body_end, region_end = region
        calls, junk = self.g.region_calls(buf[body_start:body_end])
        if not calls:  # not a call after all: keep every character
            return Step(consumed=region_end, text=buf[:region_end])
        return Step(consumed=region_end, text=buf[:p], calls=calls, after=junk)


def partial_at_end(buf: str, pos: int, marker: str) -> int | None:
    """Where the end of ``buf`` (from ``pos``) may be the beginning of ``marker``."""
    for k in range(min(len(marker) - 1, len(buf) - pos), 0, -1):
        if buf.endswith(marker[:k]):
            return len(buf) - k
    return None


class MarkerParser:
    """A :class:`ToolCallParser` for one :class:`Grammar`."""

    def __init__(self, name: str, grammar: type[Grammar], **options):
        self.name = name
        self._grammar = grammar
        self._options = options

    def streaming(self, tool_names: ToolNamesSpec = None) -> StreamingToolParser:
        return StreamingToolParser(MarkerScanner(self._grammar(ToolNames(tool_names), **self._options)))

    def parse(self, text: str, tool_names: ToolNamesSpec = None) -> ParsedOutput:
        return parse_all(self.streaming(tool_names), text)
