"""Tools for chat templates that do not declare them.

Gemma 3's own template knows nothing of tools. Following Google's documented prompting
for Gemma 3 function calling, the function definitions and the call convention go at
the start of the first user turn, earlier calls become ```tool_code``` blocks in the
model's turn and results become ```tool_output``` blocks in a user turn.
"""

from __future__ import annotations

import json

_INSTRUCTIONS = (
    "You have access to functions. If you decide to invoke any of the function(s), you "
    "MUST put it in the format of\n```tool_code\nfunction_name(param_name=value)\n```\n"
    "You SHOULD NOT include any other text in the response if you call a function.\n"
    "The function results come back in a ```tool_output``` block.\nFunctions:\n"
)


def _python_call(call: dict) -> str:
    function = call.get("function") or {}
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return f"{function.get('name', '')}({args})"
    parts = [f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in (args or {}).items()]
    return f"{function.get('name', '')}({', '.join(parts)})"


def text_of(content) -> str:
    """The text of message content: a string, or the text parts of a list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if p.get("type") == "text")


def inline_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Rewrite template-ready messages so a tool-unaware template renders tool use."""
    out: list[dict] = []
    for msg in messages:
        role = msg["role"]
        if role == "tool":
            block = f"```tool_output\n{text_of(msg.get('content')).strip()}\n```"
            if out and out[-1]["role"] == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
            continue
        item = {k: v for k, v in msg.items() if k not in ("tool_calls", "tool_call_id", "name")}
        if role == "assistant" and msg.get("tool_calls"):
            calls = "\n".join(_python_call(c) for c in msg["tool_calls"])
            text = text_of(msg.get("content"))
            item["content"] = (text + "\n" if text else "") + f"```tool_code\n{calls}\n```"
        out.append(item)
    for item in out:
        item.pop("_tool_results", None)
    if tools:
        declarations = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        _prefix_first_user(out, _INSTRUCTIONS + declarations + "\n\n")
    return out


def _prefix_first_user(messages: list[dict], prefix: str) -> None:
    for msg in messages:
        if msg["role"] == "user":
            content = msg["content"]
            if isinstance(content, list):
                msg["content"] = [{"type": "text", "text": prefix}] + content
            else:
                msg["content"] = prefix + (content or "")
            return
    messages.append({"role": "user", "content": prefix})
