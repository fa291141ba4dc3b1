"""Gemma's argument syntax as lark, from a JSON Schema: what Gemma 4 and FunctionGemma write
inside ``call:NAME{...}``.

    {city:<|"|>Paris<|"|>,days:3,tags:[<|"|>a<|"|>],opts:{metric:true}}

Keys are bare (quoted like strings when they are not plain words), strings sit between the
format's quote marker and hold no marker, numbers, booleans and null are written as in JSON
(so they follow the schema through ``%json``), objects and lists nest. Properties come in
sorted order, as Gemma's chat templates write them (``dictsort``); declared properties are
the only keys (``properties: {}`` is an empty object). A free-form object (no
``properties``), or a schema this does not model, takes any value in this syntax.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from .lark import Lark

_BARE_KEY = re.compile(r"[\w\-.$@]+")  # what values.py reads as a key without quotes
_NUMBER = r"/-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?/"
_JSON_TYPES = ("integer", "number", "boolean", "null")


class GemmaValues:
    def __init__(self, lark: Lark, quote: str, markers: Sequence[str], root: dict):
        self.lark = lark
        self.quote = quote
        self.markers = tuple(markers)  # a string may hold none of these
        self.root = root
        self._refs: dict[str, str] = {}
        self._any: str | None = None

    def arguments(self, schema: Any) -> str:
        """The ``{...}`` of a call's arguments."""
        return self._object(schema if isinstance(schema, dict) else {})

    def value(self, schema: Any) -> str:
        if not isinstance(schema, dict) or not schema:
            return self.any()
        if isinstance(schema.get("$ref"), str):
            return self._ref(schema["$ref"])
        if "const" in schema:
            return self.literal(schema["const"])
        if isinstance(schema.get("enum"), list) and schema["enum"]:
            return "(" + " | ".join(self.literal(v) for v in schema["enum"]) + ")"
        for key in ("anyOf", "oneOf"):
            branches = schema.get(key)
            if isinstance(branches, list) and branches:
                base = {k: v for k, v in schema.items() if k != key}
                return "(" + " | ".join(self.value({**base, **b} if isinstance(b, dict) else b) for b in branches) + ")"
        types = schema.get("type")
        if types is None:
            types = "object" if "properties" in schema else "array" if "items" in schema else None
        if types is None:
            return self.any()
        types = [types] if isinstance(types, str) else list(types)
        if schema.get("nullable") is True and "null" not in types:
            types.append("null")
        return "(" + " | ".join(self._typed(t, schema) for t in types) + ")"

    def _typed(self, kind: str, schema: dict) -> str:
        if kind == "string":
            return self._string(schema.get("minLength"), schema.get("maxLength"))
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return self._array(schema)
        if kind in _JSON_TYPES:  # written as JSON writes them
            return self.lark.json({k: v for k, v in schema.items() if k not in ("type", "nullable")} | {"type": kind})
        return self.any()

    def _string(self, min_len: Any = None, max_len: Any = None) -> str:
        low = min_len if isinstance(min_len, int) and min_len > 0 else 0
        high = max_len if isinstance(max_len, int) and max_len >= 0 else None
        return self.lark.delimited(self.quote, self.quote, self.markers, low, high)

    def _object(self, schema: dict) -> str:
        props = schema.get("properties")
        if not isinstance(props, dict):  # a free-form object
            pair = f"{self._key_any()} \":\" {self.any()}"
            return f'"{{" ({pair} ("," {pair})*)? "}}"'
        required = set(schema.get("required") or ())
        items = [(f'{self._key(k)} ":" {self.value(props[k])}', k in required) for k in sorted(props)]
        fields = self.lark.fields(items, '","')
        return f'"{{" {fields} "}}"'

    def _array(self, schema: dict) -> str:
        item = self.lark.rule(self.value(schema.get("items")))
        low = schema.get("minItems") if isinstance(schema.get("minItems"), int) else 0
        high = schema.get("maxItems") if isinstance(schema.get("maxItems"), int) else None
        if high is not None and high < 1:
            return '"[" "]"'
        more = f'("," {item}){{{max(low - 1, 0)},{"" if high is None else high - 1}}}'
        items = f"{item} {more}" if low > 0 else f"({item} {more})?"
        return f'"[" {items} "]"'

    def _key(self, key: str) -> str:
        return json.dumps(key) if _BARE_KEY.fullmatch(key) else self.lark.text(self.quote + key + self.quote)

    def _key_any(self) -> str:
        return f"(/[\\w\\-.$@]+/ | {self._string()})"

    def _ref(self, ref: str) -> str:
        """A local ``#/$defs/X`` (or ``#/definitions/X``) as a rule of its own, so
        recursive schemas stay finite."""
        if ref not in self._refs:
            name = self._refs[ref] = self.lark.name()
            target: Any = self.root if ref.startswith("#/") else None
            for part in ref[2:].split("/"):
                target = target.get(part) if isinstance(target, dict) else None
            self.lark.define(name, self.value(target))
        return self._refs[ref]

    def literal(self, value: Any) -> str:
        """One exact value in Gemma's syntax."""
        return self.lark.text(self._written(value))

    def _written(self, value: Any) -> str:
        if isinstance(value, str):
            return self.quote + value + self.quote
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{self._written(v)}" for k, v in sorted(value.items())) + "}"
        if isinstance(value, list):
            return "[" + ",".join(self._written(v) for v in value) + "]"
        return json.dumps(value)

    def any(self) -> str:
        """Any value in this syntax (one recursive rule)."""
        if self._any is None:
            self._any = name = self.lark.name()
            pair = f"{self._key_any()} \":\" {name}"
            self.lark.define(name, " | ".join([
                self._string(), _NUMBER, '"true"', '"false"', '"null"',
                f'"{{" ({pair} ("," {pair})*)? "}}"', f'"[" ({name} ("," {name})*)? "]"',
            ]))
        return self._any
