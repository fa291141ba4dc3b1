"""A small builder for the llguidance lark grammars that force one tool call.

Three things every format's grammar needs, kept here so each format only says its shape:

* text with the format's markers in it, where a marker the tokenizer holds as one token is
  required as that token (``<[id]>``), so the model writes it the way it was trained to;
* a JSON value following a JSON Schema (``%json {...}``, in one compact layout);
* raw text between delimiters (a Gemma ``<|"|>`` string, a GLM ``<arg_value>``) that cannot
  contain the format's markers, since the parser would take one there as the real thing.

and ``fields``: an object's properties in a fixed order, the required ones always, the
others optionally, with separators only between the ones written.
"""

from __future__ import annotations

import json
from typing import Callable, Sequence

# One conventional layout, as for response_format (engine/grammar.py).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_ANY = "/(?s:.*)/"


class Lark:
    """Rules of one grammar. ``marker_token(text)`` is the id of the single token ``text``
    encodes to, or None; ``markers`` are the format's marker texts."""

    def __init__(self, marker_token: Callable[[str], int | None], markers: Sequence[str] = (), defs: dict | None = None):
        self._marker_token = marker_token
        self._markers = tuple(markers)
        self._rules: list[str] = []
        self._count = 0
        self.defs = defs or {}  # "$defs" / "definitions" of the schema being compiled, for %json refs

    # -- rules ----------------------------------------------------------------------

    def name(self, terminal: bool = False) -> str:
        self._count += 1
        return f"T{self._count}" if terminal else f"r{self._count}"

    def define(self, name: str, body: str) -> str:
        self._rules.append(f"{name}: {body}")
        return name

    def rule(self, body: str, terminal: bool = False) -> str:
        return self.define(self.name(terminal), body)

    def grammar(self, start: str) -> str:
        import llguidance

        grammar = "%llguidance {}\n" + f"start: {start}\n" + "".join(r + "\n" for r in self._rules)
        error = llguidance.LLMatcher.validate_grammar(grammar)
        if error:
            raise ValueError(f"cannot enforce tool_choice with these tools' parameters: {error}")
        return grammar

    # -- pieces ---------------------------------------------------------------------

    def token(self, marker: str) -> int | None:
        return self._marker_token(marker) if marker in self._markers else None

    def text(self, text: str) -> str:
        """``text`` as lark items: markers that are single tokens by id, the rest as literals."""
        items, rest = [], text
        while rest:
            hits = [(rest.find(m), m) for m in self._markers if m in rest]
            if not hits:
                items.append(json.dumps(rest))
                break
            at, marker = min(hits)
            if at:
                items.append(json.dumps(rest[:at]))
            token = self.token(marker)
            items.append(f"<[{token}]>" if token is not None else json.dumps(marker))
            rest = rest[at + len(marker):]
        return " ".join(items)

    def json(self, schema) -> str:
        """A JSON value following ``schema`` (with the parameters' definitions, so local
        ``$ref``s resolve)."""
        schema = schema if isinstance(schema, dict) else {}
        return "%json " + json.dumps({**self.defs, **schema, "x-guidance": JSON_STYLE})

    def delimited(self, opener: str, closer: str, exclude: Sequence[str], min_len: int = 0,
                  max_len: int | None = None) -> str:
        """``opener``, then text of ``min_len`` to ``max_len`` characters containing none of
        ``exclude`` (nor the closer), then ``closer``.

        Delimiters that are single tokens stand outside the text's terminal; textual ones
        are part of it, so the lexer never has to guess where the text ends."""
        body = self._body(tuple(exclude) + (closer,), min_len, max_len)
        content = f"{body}?" if body and min_len == 0 else body
        open_id, close_id = self.token(opener), self.token(closer)
        if open_id is not None and close_id is not None:
            middle = content
        else:  # one terminal: the textual delimiters and the text
            inner = [json.dumps(opener)] if open_id is None else []
            inner += [content] if content else []
            inner += [json.dumps(closer)] if close_id is None else []
            middle = self.rule(" ".join(inner), terminal=True)
        items = [f"<[{open_id}]>"] if open_id is not None else []
        items += [middle] if middle else []
        items += [f"<[{close_id}]>"] if close_id is not None else []
        return " ".join(items)

    def _body(self, exclude: Sequence[str], min_len: int, max_len: int | None) -> str | None:
        """A terminal of 1 to ``max_len`` characters (at least ``min_len``) without any of
        ``exclude``; None when only the empty text is allowed."""
        if max_len is not None and max_len < 1:
            return None
        low = max(min_len, 1)
        span = f"{{{low},{'' if max_len is None else max_len}}}"
        banned = " | ".join(json.dumps(e) for e in dict.fromkeys(exclude))
        return self.rule(f"/(?s:.{span})/ & ~({_ANY} ({banned}) {_ANY})", terminal=True)

    def fields(self, items: Sequence[tuple[str, bool]], sep: str) -> str:
        """``items`` ((lark, required)) in order, the optional ones may be left out, ``sep``
        (lark, may be "") between those written. Linear in size: ``rest[i]`` is items i.. when
        something was written before them, ``first[i]`` when nothing was."""
        sep = f"{sep} " if sep else ""
        rest = first = ""
        for item, required in reversed(items):
            tail = f" {rest}" if rest else ""
            if required:
                new_rest, new_first = f"{sep}{item}{tail}", f"{item}{tail}"
            else:
                new_rest = f"({sep}{item})?{tail}"
                new_first = f"{item}{tail} | {first}" if first else f"({item}{tail})?"
            rest, first = self.rule(new_rest), self.rule(new_first)
        return first
