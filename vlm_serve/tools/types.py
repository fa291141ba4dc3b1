"""The shapes tool-call parsing produces: final results and streaming events."""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Protocol, Union

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


@dataclass
class ToolCall:
    """One parsed call. ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """Model output split into plain ``content`` and ``tool_calls``."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    """Plain text to stream as ``delta.content``."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """One OpenAI ``delta.tool_calls[]`` entry.

    The first delta of a call carries ``index``, ``id``, ``type="function"``, ``name`` and
    ``arguments=""``; later deltas carry only ``index`` and an ``arguments`` fragment. The
    fragments of a call concatenate to its final arguments JSON.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    type: str | None = None

    @property
    def arguments_fragment(self) -> str | None:
        return self.arguments


StreamEvent = Union[ContentDelta, ToolCallDelta]


@dataclass
class RawCall:
    """A call as the grammar reads it, before ids and JSON encoding."""

    name: str
    arguments: dict[str, Any]


class StreamingParser(Protocol):
    def feed(self, text: str) -> list[StreamEvent]: ...

    def finish(self) -> list[StreamEvent]: ...


class ToolCallParser(Protocol):
    """One per format. ``tool_names``: the request's declared functions (see names.py)."""

    name: str

    def parse(self, text: str, tool_names: Any = None) -> ParsedOutput: ...

    def streaming(self, tool_names: Any = None) -> StreamingParser: ...
