"""The tool-call corpus: real-world shaped model outputs with their expected parse.

One JSON file per format in tests/data/tool_calls/<format>.json, a list of cases:

    {"id": "simple",                      unique within the file
     "text": "<|tool_call>call:f{a:1}<tool_call|>",   the model output
     "content": "",                       expected content
     "calls": [{"name": "f", "arguments": {"a": 1}}], expected calls, in order
     "tool_names": ["f"],                 optional: the request's declared functions (a list,
                                          or an object name -> parameter names)
     "note": "..."}                       optional

Reuse from other tests: ``load_corpus("gemma4")``, ``tool_names_of(case)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS_DIR = Path(__file__).parent / "data" / "tool_calls"
FORMATS = ("gemma4", "function_gemma", "gemma3", "hermes", "mistral", "llama3_json", "glm4", "kimi_k2")


def load_corpus(fmt: str) -> list[dict[str, Any]]:
    with open(CORPUS_DIR / f"{fmt}.json", encoding="utf-8") as f:
        return json.load(f)


def all_cases() -> list[tuple[str, dict[str, Any]]]:
    return [(fmt, case) for fmt in FORMATS for case in load_corpus(fmt)]


def tool_names_of(case: dict[str, Any]) -> Any:
    """``tool_names`` to pass to the parser: None, a set, or a dict of signatures."""
    names = case.get("tool_names")
    return set(names) if isinstance(names, list) else names
