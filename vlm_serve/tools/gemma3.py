"""Gemma 3: prompted calls, Python-style or JSON-style.

    ```tool_code
    get_weather(city="Paris")
    ```

Items the model writes: ``f(a=1)``, a list ``[f(a=1), g(b='x')]``, ``print(f("pos"))``, a JSON
call ``{"name": "f", "arguments": {...}}`` (or ``"parameters"``; Python dict syntax too), or a
list of those; several items may follow each other, one a line.

Prose is full of ``word(...)``, so calls are only taken where they are unambiguous:

* in a tool fence (```` ```tool_code ````, ``tool_call``, ...): any function name;
* when the whole output is nothing but items (bare, or in one ```` ``` ```` / ```` ```json ````
  fence): any name. Only known at the end of the output, so such calls stream at the end;
* anywhere, when the request declared its tools (``tool_names``): an item whose every call
  names a declared function, bare or in any fence (but not right after a backtick: that is
  inline code). Then the whole-output rule is not used: undeclared names are never calls
  outside a tool fence.

A fence that held only calls is removed from the content; anything else stays content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .calls import ToolNames, ToolNamesSpec, build_args, read_call_object
from .streaming import Step, StreamingToolParser, hold, parse_all
from .types import ParsedOutput, RawCall
from .values import Incomplete, Invalid, Reader

TOOL_FENCE_LANGS = frozenset({
    "tool_code", "tool_call", "tool_calls", "tool", "tools",
    "function_call", "function_calls", "functions",
})
_WHOLE_OUTPUT_FENCE_LANGS = frozenset({"", "json"})
_NAME = re.compile(r"[A-Za-z_][\w\-]*(?:[.:][A-Za-z_][\w\-]*)*")
_NAME_CHAR = re.compile(r"[\w.\-:`]")  # what may not come right before a call's name
_LANG = re.compile(r"[\w\-]*")
_FENCE = "```"
_SEPARATORS = " \t\r\n,;"


@dataclass(frozen=True)
class _Rules:
    names: ToolNames
    any_name: bool  # undeclared function names are calls
    fence_langs: frozenset[str] | None  # fences besides tool fences that may hold calls (None: any)


# -- grammar -------------------------------------------------------------------------


def read_item(r: Reader, rules: _Rules) -> tuple[list[RawCall], bool]:
    """One item at ``r.pos``: its calls, and whether it was a tool fence."""
    if r.starts(_FENCE):
        return _read_fence(r, rules)
    return _read_calls(r, rules), False


def _read_fence(r: Reader, rules: _Rules) -> tuple[list[RawCall], bool]:
    r.pos += len(_FENCE)
    m = _LANG.match(r.text, r.pos)
    assert m is not None
    if m.end() >= len(r.text) and not r.eof:
        raise Incomplete
    lang = m.group().lower()
    r.pos = m.end()
    tool_fence = lang in TOOL_FENCE_LANGS
    if tool_fence:
        rules = replace(rules, any_name=True)
    elif rules.fence_langs is not None and lang not in rules.fence_langs:
        raise Invalid(f"a {lang or 'plain'} fence")
    calls: list[RawCall] = []
    while True:
        _skip_separators(r)
        if r.pos >= len(r.text):
            if not r.eof:
                raise Incomplete
            break  # output ended inside the fence: complete calls still count
        if r.starts(_FENCE):
            r.pos += len(_FENCE)
            break
        calls.extend(_read_calls(r, rules))
    if not calls:
        raise Invalid("a fence without calls")
    return calls, tool_fence


def _read_calls(r: Reader, rules: _Rules) -> list[RawCall]:
    """A call or a ``[...]`` list of calls."""
    if r.char(r.pos) != "[":
        return [_read_call(r, rules)]
    r.pos += 1
    calls: list[RawCall] = []
    while True:
        r.skip_ws()
        c = r.char(r.pos)
        if c == "":
            r.more()
        if c == "]":
            if not calls:
                raise Invalid("an empty list")
            r.pos += 1
            return calls
        if c == ",":
            r.pos += 1
            continue
        calls.append(_read_call(r, rules))


def _read_call(r: Reader, rules: _Rules) -> RawCall:
    if r.char(r.pos) == "{":
        return read_call_object(r, rules.names, rules.any_name)
    m = _NAME.match(r.text, r.pos)
    if not m:
        raise Invalid("not a call")
    end = m.end()
    after = r.char(end)  # Incomplete while the name may go on
    if after in (".", ":"):
        r.char(end + 1)  # "ns." may become "ns.f(": Incomplete until that is known
    if after != "(":
        raise Invalid("not a call")
    name = m.group()
    r.pos = end + 1
    if name == "print" and rules.names.resolve(name) is None:  # print(f(x)) is f(x)
        r.skip_ws()
        call = _read_call(r, rules)
        r.skip_ws()
        if r.char(r.pos) != ")":
            raise Invalid("print() of more than a call")
        r.pos += 1
        return call
    name = rules.names.accept(name, rules.any_name)
    pairs = r.read_pairs(")", positional=True)
    return RawCall(name, build_args(pairs, rules.names.params(name)))


def _skip_separators(r: Reader) -> None:
    while r.pos < len(r.text) and r.text[r.pos] in _SEPARATORS:
        r.pos += 1


# -- scanning ------------------------------------------------------------------------


class Gemma3Scanner:
    def __init__(self, names: ToolNames):
        self._names = names
        declared = names.declared is not None
        # Whole-output mode: only without declared names, only until the output is
        # seen to be something other than calls.
        self._whole = not declared
        self._whole_rules = _Rules(names, any_name=True, fence_langs=_WHOLE_OUTPUT_FENCE_LANGS)
        self._rules = _Rules(names, any_name=False, fence_langs=None if declared else frozenset())
        # A name right after a backtick is inline code (`f(x)`), not a call.
        self._candidate = re.compile(r"`|\[|\{|(?<![\w.\-:`])[A-Za-z_]" if declared else r"`")

    def scan(self, buf: str, prev: str, final: bool) -> Step | None:
        if self._whole:
            try:
                return self._scan_whole(buf, final)
            except Invalid:
                self._whole = False
        return self._scan_inline(buf, prev, final)

    def _scan_whole(self, buf: str, final: bool) -> Step | None:
        """The output so far as items only. Calls from tool fences at its head are
        emitted at once; any other call waits for the end of the output."""
        r = Reader(buf, eof=final)
        items: list[tuple[int, int, list[RawCall], bool]] = []  # start, end, calls, tool fence
        try:
            while True:
                _skip_separators(r)
                if r.pos >= len(buf):
                    break
                start = r.pos
                calls, tool_fence = read_item(r, self._whole_rules)
                items.append((start, r.pos, calls, tool_fence))
        except Incomplete:  # only when not final
            pass
        if final:  # the whole output was items: all of them are calls
            head = buf[:items[0][0]] if items else buf
            return Step(consumed=len(buf), text=head, calls=[c for i in items for c in i[2]])
        eager = 0
        while eager < len(items) and items[eager][3]:
            eager += 1
        if not eager:
            return None
        return Step(consumed=items[eager - 1][1], text=buf[:items[0][0]],
                    calls=[c for i in items[:eager] for c in i[2]])

    def _scan_inline(self, buf: str, prev: str, final: bool) -> Step | None:
        pos = 0
        while True:
            found = self._next(buf, pos, prev, final)
            if found is None:
                return Step(consumed=len(buf), text=buf)
            p, partial = found
            if partial:
                return hold(buf, p)
            r = Reader(buf, p, eof=final)
            try:
                calls, _ = read_item(r, self._rules)
            except Incomplete:
                return hold(buf, p)
            except Invalid:
                pos = p + 1
                continue
            return Step(consumed=r.pos, text=buf[:p], calls=calls)

    def _next(self, buf: str, pos: int, prev: str, final: bool) -> tuple[int, bool] | None:
        """(where an item may start, whether the text there is too short to tell)."""
        while True:
            m = self._candidate.search(buf, pos)
            if not m:
                return None
            p = m.start()
            c = buf[p]
            if c == "`":
                if buf.startswith(_FENCE, p):
                    return p, False
                if not final and _FENCE.startswith(buf[p:]):
                    return p, True
                pos = p + 1
                continue
            if c in "[{":
                return p, False
            if p == 0 and prev and _NAME_CHAR.match(prev):  # inside a word, or inline code
                pos = _NAME.match(buf, p).end()
                continue
            name = _NAME.match(buf, p)
            end = name.end()
            if end >= len(buf) or (buf[end] in ".:" and end + 1 >= len(buf)):
                if final:
                    return None
                return p, True
            if buf[end] == "(" and (name.group() == "print" or self._names.resolve(name.group())):
                return p, False
            pos = end


class Gemma3Parser:
    """A :class:`ToolCallParser` for Gemma 3 prompted calls."""

    name = "gemma3"

    def streaming(self, tool_names: ToolNamesSpec = None) -> StreamingToolParser:
        # Calls without an end marker are only seen to end by parsing them, so a long
        # held item is re-parsed only after it grew by an eighth.
        return StreamingToolParser(Gemma3Scanner(ToolNames(tool_names)), rescan_growth=1.125)

    def parse(self, text: str, tool_names: ToolNamesSpec = None) -> ParsedOutput:
        return parse_all(self.streaming(tool_names), text)


def parser() -> Gemma3Parser:
    return Gemma3Parser()
