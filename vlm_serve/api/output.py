"""Turning generated text into OpenAI message fields, incrementally.

One ``OutputProcessor`` per request. It is fed text deltas as they are decoded and
yields message deltas (``content``, later ``reasoning_content`` and ``tool_calls``);
streaming and non-streaming responses are both built from these deltas, so they agree.
"""

from __future__ import annotations


class OutputProcessor:
    def __init__(self):
        self.has_tool_calls = False

    def feed(self, text: str) -> list[dict]:
        return [{"content": text}] if text else []

    def finish(self) -> list[dict]:
        return []


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
    message = {"role": "assistant", "content": "".join(content) if content or not calls else None}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message
