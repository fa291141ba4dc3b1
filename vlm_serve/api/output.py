"""Turning generated text into OpenAI message fields, incrementally.

One ``OutputProcessor`` per request. It is fed text as it is decoded and returns message
deltas: ``reasoning_content`` for a model's thinking, ``tool_calls`` for the calls its
tool-call parser recognises, ``content`` for the rest. Streaming and non-streaming
responses are both built from these deltas, so they agree.
"""

from __future__ import annotations

from ..tools import ContentDelta, StreamingToolParser, ToolCallDelta
from .reasoning import ReasoningFormat, ReasoningSplitter


class OutputProcessor:
    def __init__(self, reasoning: ReasoningFormat | None = None, tools: StreamingToolParser | None = None):
        self._splitter = ReasoningSplitter(reasoning) if reasoning else None
        self._tools = tools
        self.has_tool_calls = False

    def feed(self, text: str) -> list[dict]:
        if not text:
            return []
        pieces = self._splitter.feed(text) if self._splitter else [("content", text)]
        return self._route(pieces)

    def finish(self) -> list[dict]:
        deltas = self._route(self._splitter.finish()) if self._splitter else []
        if self._tools is not None:
            deltas += self._tool_deltas(self._tools.finish())
        return deltas

    def _route(self, pieces: list[tuple[str, str]]) -> list[dict]:
        out = []
        for field, text in pieces:
            if field == "content" and self._tools is not None:
                out += self._tool_deltas(self._tools.feed(text))
            elif text:
                out.append({field: text})
        return out

    def _tool_deltas(self, events) -> list[dict]:
        out = []
        for event in events:
            if isinstance(event, ContentDelta):
                if event.text:
                    out.append({"content": event.text})
            elif isinstance(event, ToolCallDelta):
                self.has_tool_calls = True
                call: dict = {"index": event.index}
                if event.id is not None:
                    call["id"] = event.id
                    call["type"] = "function"
                function = {}
                if event.name is not None:
                    function["name"] = event.name
                if event.arguments is not None:
                    function["arguments"] = event.arguments
                call["function"] = function
                out.append({"tool_calls": [call]})
        return out


def merge_deltas(deltas: list[dict]) -> dict:
    """Fold message deltas into one assistant message (for non-streaming responses)."""
    content, reasoning, calls = [], [], {}
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        if "reasoning_content" in delta:
            reasoning.append(delta["reasoning_content"])
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(
                call["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            entry["id"] = call.get("id") or entry["id"]
            fn = call.get("function", {})
            entry["function"]["name"] += fn.get("name") or ""
            entry["function"]["arguments"] += fn.get("arguments") or ""
    text = "".join(content)
    message = {"role": "assistant", "content": text if text or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
