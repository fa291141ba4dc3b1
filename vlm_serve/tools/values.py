"""A lenient reader for the argument syntax models really emit.

One reader covers Gemma 4 / FunctionGemma arguments (``{key:<|"|>text<|"|>,n:3}``), Python
keyword arguments (``(city="Paris", n=3)``) and JSON or Python literals inside values
(``{"a": [1, True, None]}``). It forgives what models get wrong: single or double quotes
instead of the format's string delimiter, a ``"`` inside a string, bare (unquoted) strings,
``=`` for ``:``, a missing comma between arguments.

It is *prefix-monotone*, which streaming relies on: given a prefix of the text with
``eof=False``, it either raises :class:`Incomplete` or returns exactly what it returns for
every longer text. It never decides anything from the absence of text it has not seen.
With ``eof=True`` the text is all there is, and running out means :class:`Invalid`.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, NoReturn


class Incomplete(Exception):
    """The text ends before the construct does; more text may complete it."""


class Invalid(Exception):
    """The text is not (a prefix of) the construct."""


WS = " \t\r\n"
CLOSERS = ")]}"
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_BARE_KEY = re.compile(r"[\w\-.$@]+")
_KEYLIKE = re.compile(r"[A-Za-z_][\w\-.]*[ \t]*")
_HEX4 = re.compile(r"[0-9a-fA-F]{4}")
_LITERALS: dict[str, Any] = {
    "true": True, "True": True, "false": False, "False": False,
    "null": None, "None": None, "none": None,
}
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f",
            "\\": "\\", "/": "/", '"': '"', "'": "'"}


def classify(token: str) -> Any:
    """A bare token as a value: literal, finite number, or else the string itself."""
    if token in _LITERALS:
        return _LITERALS[token]
    if _NUMBER.fullmatch(token):
        digits = token.lstrip("+-")
        if len(digits) > 1 and digits[0] == "0" and digits[1].isdigit():
            return token  # "02134" is a zip code, not 2134
        try:
            if any(ch in token for ch in ".eE"):
                number = float(token)
                return number if math.isfinite(number) else token
            return int(token)
        except ValueError:  # e.g. more digits than int() accepts
            return token
    return token


def unescape(text: str) -> str:
    """Decode JSON / Python backslash escapes; keep any that are not valid as written."""
    if "\\" not in text:
        return text
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "\\" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt in _ESCAPES:
            out.append(_ESCAPES[nxt])
            i += 2
        elif nxt == "u" and _HEX4.fullmatch(text, i + 2, i + 6):
            code = int(text[i + 2:i + 6], 16)
            if 0xD800 <= code < 0xDC00 and text.startswith("\\u", i + 6) \
                    and _HEX4.fullmatch(text, i + 8, i + 12) \
                    and 0xDC00 <= int(text[i + 8:i + 12], 16) < 0xE000:
                low = int(text[i + 8:i + 12], 16)
                out.append(chr(0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)))
                i += 12
            elif 0xD800 <= code < 0xE000:  # lone surrogate: not encodable, keep the text
                out.append(text[i:i + 6])
                i += 6
            else:
                out.append(chr(code))
                i += 6
        else:
            out.append(ch)
            i += 1
    return "".join(out)


class Reader:
    """A cursor over ``text`` that reads values, objects, lists and argument lists.

    ``raw_quote`` is the format's own string delimiter (``<|"|>``, ``<escape>``): text
    between two of them is taken verbatim.
    """

    def __init__(self, text: str, pos: int = 0, *, eof: bool, raw_quote: str | None = None):
        self.text = text
        self.pos = pos
        self.eof = eof
        self.raw_quote = raw_quote

    # -- primitives ---------------------------------------------------------------

    def more(self) -> NoReturn:
        """Ran out of text: unterminated at the end, or wait for more."""
        if self.eof:
            raise Invalid("unterminated")
        raise Incomplete

    def char(self, i: int) -> str:
        """The character at ``i``; "" at the true end of the text."""
        if i < len(self.text):
            return self.text[i]
        if self.eof:
            return ""
        raise Incomplete

    def starts(self, s: str, i: int | None = None) -> bool:
        """Whether ``s`` is at ``i``; Incomplete while the text seen is a prefix of it."""
        i = self.pos if i is None else i
        if len(self.text) - i >= len(s):
            return self.text.startswith(s, i)
        if not self.eof and s.startswith(self.text[i:]):
            raise Incomplete
        return False

    def skip_ws(self) -> None:
        text, i = self.text, self.pos
        while i < len(text) and text[i] in WS:
            i += 1
        self.pos = i

    def next_char(self) -> str:
        """Skip whitespace and return the next character; running out of text there is
        unterminated (at the end) or incomplete (more may come)."""
        self.skip_ws()
        c = self.char(self.pos)
        if c == "":
            self.more()
        return c

    def _ws_end(self, i: int) -> int:
        text = self.text
        while i < len(text) and text[i] in WS:
            i += 1
        return i

    def keylike(self, i: int) -> bool:
        """Whether an argument ``name=`` or ``name:`` starts at ``i`` (a missing comma)."""
        m = _KEYLIKE.match(self.text, i)
        if not m:
            return False
        e = m.end()
        c = self.char(e)
        if c == "=":
            return self.char(e + 1) != "="
        if c == ":":
            return self.char(e + 1) != "/"  # "http://..." is not a key
        return False

    # -- values -------------------------------------------------------------------

    def read_value(self, closer: str, in_object: bool) -> Any:
        """One value inside a container that ends with ``closer``."""
        c = self.next_char()
        if self.raw_quote and c == self.raw_quote[0] and self.starts(self.raw_quote):
            return self.read_raw()
        if c in ("'", '"'):
            return self.read_quoted(closer, in_object)
        if c == "{":
            self.pos += 1
            return dict(self.read_pairs("}", positional=False))
        if c in ("[", "("):
            self.pos += 1
            return self.read_list("]" if c == "[" else ")")
        return self.read_bare(closer, in_object)

    def read_raw(self) -> str:
        q = self.raw_quote
        assert q is not None
        start = self.pos + len(q)
        end = self.text.find(q, start)
        if end < 0:
            self.more()
        self.pos = end + len(q)
        return self.text[start:end]

    def read_quoted(self, closer: str, in_object: bool, key: bool = False) -> str:
        """A '...' or "..." string (or a triple-quoted one).

        A quote that is not followed by what may follow a value (a comma, the closer, the
        end, or in an argument list a next ``name=``) is taken as part of the string.
        """
        text, q = self.text, self.text[self.pos]
        if self.starts(q * 3):
            start = self.pos + 3
            end = text.find(q * 3, start)
            if end < 0:
                self.more()
            self.pos = end + 3
            return unescape(text[start:end])
        i = self.pos + 1
        while True:
            j = _find_either(text, q, "\\", i)
            if j < 0:
                self.more()
            if text[j] == "\\":
                i = j + 2
                continue
            if self._quote_closes(j + 1, closer, in_object, key):
                value = unescape(text[self.pos + 1:j])
                self.pos = j + 1
                return value
            i = j + 1

    def _quote_closes(self, i: int, closer: str, in_object: bool, key: bool) -> bool:
        j = self._ws_end(i)
        c = self.char(j)
        if c == "" or c == "," or c == closer:
            return True
        if key and c in (":", "="):
            return True
        return in_object and j > i and self.keylike(j)

    def read_bare(self, closer: str, in_object: bool) -> Any:
        """An unquoted token: a literal, a number, or a bare string.

        In a list a comma ends it. In an object or argument list a comma ends it only
        when what follows looks like another argument, so ``text:Hello, World`` keeps its
        comma; whitespace followed by ``name:`` also ends it (a missing comma).
        """
        text, start, i, depth = self.text, self.pos, self.pos, 0
        while True:
            c = self.char(i)
            if c == "":
                break
            if depth == 0:
                if c in CLOSERS:
                    break
                if c == ",":
                    if not in_object or self._comma_ends(i, start):
                        break
                elif c in WS and in_object:
                    j = self._ws_end(i)
                    if self.char(j) == "" or self.keylike(j):
                        break
                    i = j
                    continue
            if c in "([{":
                depth += 1
            elif c in CLOSERS:
                depth -= 1
            i += 1
        self.pos = i
        return classify(text[start:i].strip())

    def _comma_ends(self, i: int, start: int) -> bool:
        if not isinstance(classify(self.text[start:i].strip()), str):
            return True
        if not self.text[start:i].strip():
            return True
        j = self._ws_end(i + 1)
        c = self.char(j)
        if c == "" or c in CLOSERS or c in "\"'{[(-" or c.isdigit():
            return True
        if self.raw_quote and self.starts(self.raw_quote, j):
            return True
        return self.keylike(j)

    # -- containers ---------------------------------------------------------------

    def read_list(self, closer: str) -> list[Any]:
        """Items up to ``closer`` (the opening bracket already read)."""
        items: list[Any] = []
        while True:
            c = self.next_char()
            if c == closer:
                self.pos += 1
                return items
            if c == ",":
                self.pos += 1
                continue
            items.append(self.read_value(closer, in_object=False))
            c = self.next_char()
            if c != closer and c != "," and c not in "\"'{[(" and not c.isdigit():
                raise Invalid(f"unexpected {c!r} in a list")

    def read_pairs(
        self,
        closer: str,
        *,
        positional: bool,
        key_ok: Callable[[str], bool] | None = None,
    ) -> list[tuple[str | None, Any]]:
        """``key: value`` / ``key=value`` entries up to ``closer`` (opening already read).

        With ``positional``, entries without a key are kept with key None (call arguments).
        ``key_ok`` rejects unwanted keys early, so non-matching text fails fast.
        """
        pairs: list[tuple[str | None, Any]] = []
        while True:
            c = self.next_char()
            if c == closer:
                self.pos += 1
                return pairs
            if c in (",", ";"):
                self.pos += 1
                continue
            key = self._try_key(closer)
            if key is None and not positional:
                raise Invalid("expected a key")
            if key is not None and key_ok is not None and not key_ok(key):
                raise Invalid(f"unexpected key {key!r}")
            pairs.append((key, self.read_value(closer, in_object=True)))
            c = self.next_char()
            if c != closer and c not in (",", ";") and not self.keylike(self.pos):
                raise Invalid(f"unexpected {c!r} after a value")

    def _try_key(self, closer: str) -> str | None:
        """Read ``key`` and its ``:``/``=`` if there is one; else leave pos alone."""
        start, text = self.pos, self.text
        c = text[start]
        if self.raw_quote and c == self.raw_quote[0] and self.starts(self.raw_quote):
            key = self.read_raw()
        elif c in ("'", '"'):
            key = self.read_quoted(closer, in_object=True, key=True)
        else:
            m = _BARE_KEY.match(text, start)
            if not m:
                return None
            if m.end() >= len(text) and not self.eof:
                raise Incomplete
            key = m.group()
            self.pos = m.end()
        self.skip_ws()
        c = self.char(self.pos)
        if c == ":" or (c == "=" and self.char(self.pos + 1) != "="):
            self.pos += 1
            return key
        self.pos = start
        return None


def _find_either(text: str, a: str, b: str, start: int) -> int:
    i, j = text.find(a, start), text.find(b, start)
    if i < 0:
        return j
    return i if j < 0 else min(i, j)


def object_from_text(text: str) -> dict[str, Any]:
    """An arguments object given as a string (double-encoded JSON, or lenient syntax)."""
    if not text.strip():
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        reader = Reader(text.strip(), eof=True)
        if reader.char(0) != "{":
            raise Invalid("arguments string is not an object") from None
        reader.pos = 1
        value = dict(reader.read_pairs("}", positional=False))
        reader.skip_ws()
        if reader.pos != len(reader.text):
            raise Invalid("text after the arguments object") from None
    if not isinstance(value, dict):
        raise Invalid("arguments are not an object")
    return value
