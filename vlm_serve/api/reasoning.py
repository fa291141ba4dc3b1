"""Separating a model's thinking from its answer, incrementally.

Gemma 4 thinks in ``<|channel>thought\\n ... <channel|>`` before answering; that text
goes to ``reasoning_content``, the rest to ``content``. Text that might be the start of
a marker is held back until the next piece decides.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    label: str = ""  # a channel name right after ``start`` that is not part of the thought


GEMMA4 = ReasoningFormat(start="<|channel>", end="<channel|>", label="thought")


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    def __init__(self, fmt: ReasoningFormat):
        self.fmt = fmt
        self._buffer = ""
        self._thinking = False
        self._at_label = False  # just after ``start``: the label may still be arriving

    def feed(self, text: str) -> list[tuple[str, str]]:
        """Returns ``(field, text)`` pieces; field is "content" or "reasoning_content"."""
        self._buffer += text
        out: list[tuple[str, str]] = []
        while self._buffer:
            if self._at_label and not self._strip_label():
                break
            marker = self.fmt.end if self._thinking else self.fmt.start
            field = "reasoning_content" if self._thinking else "content"
            i = self._buffer.find(marker)
            if i >= 0:
                if i:
                    out.append((field, self._buffer[:i]))
                self._buffer = self._buffer[i + len(marker):]
                self._thinking = not self._thinking
                self._at_label = self._thinking
                continue
            keep = _partial_suffix(self._buffer, marker)
            ready = self._buffer[: len(self._buffer) - keep]
            if ready:
                out.append((field, ready))
            self._buffer = self._buffer[len(ready):]
            break
        return out

    def finish(self) -> list[tuple[str, str]]:
        field = "reasoning_content" if self._thinking else "content"
        rest, self._buffer = self._buffer, ""
        return [(field, rest)] if rest else []

    def _strip_label(self) -> bool:
        """Drop the channel label (and one newline) after ``start``; False = wait."""
        label = self.fmt.label
        candidate = self._buffer
        if len(candidate) < len(label) + 1 and (label + "\n").startswith(candidate):
            return False  # could still be "thought\n"
        if candidate.startswith(label):
            candidate = candidate[len(label):]
            if candidate.startswith("\n"):
                candidate = candidate[1:]
        self._buffer = candidate
        self._at_label = False
        return True
