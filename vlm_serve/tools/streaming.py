"""The streaming machine every format runs on, and ``parse`` built from it.

A format supplies a *scanner*: given the text not yet consumed, it returns a :class:`Step`
(content to emit, calls found, how much text that used) or None to wait for more text.
Scanners only decide what the text seen so far already decides (see values.py), so feeding
text in any chunks gives the same result, and ``parse(text)`` is simply feeding all of it at
once: streaming and non-streaming cannot disagree.

A call is emitted when it is complete. That is what lets an unterminated call (generation
cut at max_tokens) fall back to content, exactly as the non-streaming parse has it.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Protocol

from .types import ContentDelta, ParsedOutput, RawCall, StreamEvent, ToolCall, ToolCallDelta, new_call_id

log = logging.getLogger(__name__)


@dataclass
class Step:
    """``text`` (content), then ``calls``, then ``after`` (content): ``consumed`` chars."""

    consumed: int
    text: str = ""
    calls: list[RawCall] = field(default_factory=list)
    after: str = ""


class Scanner(Protocol):
    def scan(self, buf: str, prev: str, final: bool) -> Step | None:
        """Next step for ``buf``; None: wait for more text (never when ``final``).
        ``prev`` is the last character already consumed ("" at the start)."""


def hold(buf: str, p: int) -> Step | None:
    """Emit the content before ``p``, keep the rest for later."""
    return Step(consumed=p, text=buf[:p]) if p > 0 else None


class _ContentJoiner:
    """Joins the content around calls: whitespace that only separated text from calls goes.

    Text before and after a run of calls is joined by the whitespace before or after the run,
    whichever has more line breaks (before, on a tie); whitespace at the start before a call
    or at the end after one is dropped. With no calls the content is the text, unchanged. Whitespace is held
    back until the next visible text shows where it belongs.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._before_calls: str | None = None  # not None: calls since the last text
        self._started = False

    def text(self, s: str) -> str:
        core = s.strip()
        if not core:
            self._pending += s
            return ""
        lead = s[: len(s) - len(s.lstrip())]
        trail = s[len(s.rstrip()):]
        around = self._pending + lead
        if self._before_calls is None:
            sep = around
        else:
            # the more line-breaking of the whitespace before and after the calls
            sep = max(self._before_calls, around, key=lambda w: w.count("\n")) if self._started else ""
            self._before_calls = None
        self._pending = trail
        self._started = True
        return sep + core

    def call(self) -> None:
        if self._before_calls is None:
            self._before_calls = self._pending
        self._pending = ""

    def finish(self) -> str:
        out = "" if self._before_calls is not None else self._pending
        self._pending = ""
        return out


class StreamingToolParser:
    """Per-request streaming state: ``feed`` decoded text chunks, then ``finish``.

    Holds back only what may still turn out to be (part of) a call, plus whitespace next
    to it; everything else is emitted as content at once.
    """

    def __init__(self, scanner: Scanner, *, rescan_growth: float = 1.0):
        self._scanner = scanner
        self._growth = rescan_growth
        self._buf = ""
        self._prev = ""
        self._retry_at = 0
        self._joiner = _ContentJoiner()
        self._calls = 0
        self._finished = False

    @property
    def num_calls(self) -> int:
        """Calls emitted so far (finish_reason is "tool_calls" when this is > 0)."""
        return self._calls

    def feed(self, text: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if not text:
            return []
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> list[StreamEvent]:
        """End of generation: flush what was held; an unterminated call becomes content."""
        if self._finished:
            return []
        events = self._drain(final=True)
        self._finished = True
        tail = self._joiner.finish()
        if tail:
            events.append(ContentDelta(tail))
        return _merge(events)

    def _drain(self, final: bool) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        while self._buf:
            if not final and len(self._buf) < self._retry_at:
                break
            step = self._scan(final)
            if step is None:
                # The held text did not decide yet. Scanning again costs a pass over it, so
                # for formats whose calls end without a marker wait until it has grown.
                # (The scanner may say so itself, call by call, with its own rescan_growth.)
                n = len(self._buf)
                growth = getattr(self._scanner, "rescan_growth", self._growth)
                self._retry_at = n + 1 if growth <= 1 or n < 256 else int(n * growth)
                break
            self._retry_at = 0
            self._apply(step, events)
        return _merge(events)

    def _scan(self, final: bool) -> Step | None:
        buf = self._buf
        try:
            step = self._scanner.scan(buf, self._prev, final)
        except Exception:  # a parser bug must not fail the request: keep the text
            log.exception("tool-call scanner failed; passing text through")
            step = Step(consumed=1, text=buf[0])
        if step is not None and not 0 < step.consumed <= len(buf):
            log.error("tool-call scanner returned a bad step: %r", step)
            step = Step(consumed=len(buf), text=buf) if final else None
        if step is None and final:
            step = Step(consumed=len(buf), text=buf)
        return step

    def _apply(self, step: Step, events: list[StreamEvent]) -> None:
        self._prev = self._buf[step.consumed - 1]
        self._buf = self._buf[step.consumed:]
        self._content(step.text, events)
        for call in step.calls:
            try:
                arguments = json.dumps(call.arguments, ensure_ascii=False)
            except (TypeError, ValueError):
                arguments = json.dumps(call.arguments, ensure_ascii=False, default=str)
            self._joiner.call()
            index = self._calls
            self._calls += 1
            events.append(ToolCallDelta(index=index, id=new_call_id(), name=call.name, arguments="",
                                        type="function"))
            events.append(ToolCallDelta(index=index, arguments=arguments))
        self._content(step.after, events)

    def _content(self, text: str, events: list[StreamEvent]) -> None:
        if text:
            out = self._joiner.text(text)
            if out:
                events.append(ContentDelta(out))


def _merge(events: list[StreamEvent]) -> list[StreamEvent]:
    """Adjacent content deltas as one."""
    out: list[StreamEvent] = []
    for event in events:
        if isinstance(event, ContentDelta) and out and isinstance(out[-1], ContentDelta):
            out[-1] = ContentDelta(out[-1].text + event.text)
        else:
            out.append(event)
    return out


def collect(events: list[StreamEvent]) -> ParsedOutput:
    """The final result that a list of stream events adds up to."""
    content: list[str] = []
    calls: dict[int, ToolCall] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
            continue
        call = calls.setdefault(event.index, ToolCall(id="", name="", arguments=""))
        if event.id:
            call.id = event.id
        if event.name:
            call.name += event.name
        if event.arguments:
            call.arguments += event.arguments
    return ParsedOutput("".join(content), [calls[i] for i in sorted(calls)])


def parse_all(parser: StreamingToolParser, text: str) -> ParsedOutput:
    """Non-streaming parse: the whole text through the streaming machine."""
    return collect(parser.feed(text) + parser.finish())
