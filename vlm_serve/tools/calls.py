"""What every format shares about a call: declared names, argument objects, JSON calls."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Union

from .types import RawCall
from .values import Invalid, Reader, object_from_text, unescape

#: What parsers accept as ``tool_names``: None (nothing declared), the declared function
#: names, or a mapping name -> parameter names in declaration order (used to name
#: positional arguments), or name -> {parameter: JSON schema type} (see :func:`tool_signatures`).
ToolNamesSpec = Union[None, Collection[str], Mapping[str, Sequence[str]]]

#: Keys a JSON-style call object may have at its top level.
CALL_OBJECT_KEYS = frozenset({"name", "arguments", "parameters", "args", "function", "type", "id"})
_ARGUMENT_KEYS = ("arguments", "parameters", "args")
_NAMESPACES = ("default_api.", "functions.")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', re.S)


class ToolNames:
    """The request's declared functions, as far as parsing needs them."""

    def __init__(self, spec: ToolNamesSpec = None):
        if isinstance(spec, str):
            spec = [spec]
        if isinstance(spec, ToolNames):
            self.declared, self._params, self._types = spec.declared, spec._params, spec._types
            return
        self._types: dict[str, Mapping[str, Any]] = {}
        if spec is None:
            self.declared: frozenset[str] | None = None
            self._params: dict[str, list[str]] = {}
        elif isinstance(spec, Mapping):
            self.declared = frozenset(spec)
            self._params = {name: list(params or ()) for name, params in spec.items()}
            self._types = {name: params for name, params in spec.items() if isinstance(params, Mapping)}
        else:
            self.declared = frozenset(spec)
            self._params = {}

    def resolve(self, name: str) -> str | None:
        """The declared name ``name`` means: itself, or the part after a namespace
        (``default_api.get_weather``, ``functions:get_weather``); None if not declared."""
        if self.declared is None:
            return None
        if name in self.declared:
            return name
        for sep in ".:":
            tail = name.rsplit(sep, 1)[-1]
            if tail in self.declared:
                return tail
        return None

    def canonical(self, name: str) -> str:
        """The name to report: the declared one it means, else ``name`` without a
        ``default_api.`` / ``functions.`` namespace (Gemini-style prefixes)."""
        declared = self.resolve(name)
        if declared is not None:
            return declared
        for prefix in _NAMESPACES:
            if name.startswith(prefix) and len(name) > len(prefix):
                return name[len(prefix):]
        return name

    def accept(self, name: str, any_name: bool) -> str:
        """The name to report; Invalid when only declared names are allowed."""
        if self.resolve(name) is None and not any_name:
            raise Invalid(f"{name!r} is not a declared function")
        return self.canonical(name)

    def params(self, name: str) -> list[str]:
        return self._params.get(name, [])

    def is_string(self, name: str, param: str) -> bool:
        """Whether the declared schema types ``param`` of ``name`` as a string."""
        kind = self._types.get(name, {}).get(param)
        return kind == "string" or (isinstance(kind, (list, tuple)) and "string" in kind)


def tool_signatures(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """``tool_names`` for parsers from an OpenAI ``tools`` list: name -> {parameter: its
    schema ``type`` (None if not given)}, parameters in declaration order."""
    if not tools:
        return None
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        props = props if isinstance(props, Mapping) else {}
        out[fn["name"]] = {k: v.get("type") if isinstance(v, Mapping) else None for k, v in props.items()}
    return out


def build_args(pairs: list[tuple[str | None, Any]], param_names: Sequence[str]) -> dict[str, Any]:
    """Keyword and positional arguments as one object.

    A positional argument takes the declared parameter name at its position when known,
    else ``arg0``, ``arg1``, ...
    """
    args: dict[str, Any] = {}
    index = 0
    for key, value in pairs:
        if key is None:
            key = param_names[index] if index < len(param_names) else f"arg{index}"
            index += 1
        args[key] = value
    return args


def read_call_object(reader: Reader, names: ToolNames, any_name: bool) -> RawCall:
    """A JSON-style call: ``{"name": ..., "arguments": {...}}`` (or ``"parameters"``,
    ``"args"``, or wrapped as ``{"type": "function", "function": {...}}``).

    Other top-level keys fail at once, so ordinary JSON is not held back while streaming.
    Without an arguments key the name must be declared (``{"name": "Bob"}`` is data).
    """
    if reader.char(reader.pos) != "{":
        raise Invalid("not an object")
    reader.pos += 1
    obj = dict(reader.read_pairs("}", positional=False, key_ok=CALL_OBJECT_KEYS.__contains__))
    body = obj
    if isinstance(obj.get("function"), Mapping):
        body = obj["function"]
    elif isinstance(obj.get("function"), str) and "name" not in obj:
        body = {**obj, "name": obj["function"]}
    name = body.get("name")
    if not isinstance(name, str) or not name.strip():
        raise Invalid("call object without a name")
    name = names.accept(name.strip(), any_name)
    key = next((k for k in _ARGUMENT_KEYS if k in body), None)
    if key is None and names.resolve(name) is None:
        raise Invalid("object with a name but no arguments")
    args = body.get(key) if key else None
    if args is None:
        args = {}
    elif isinstance(args, str):
        args = object_from_text(args)
    if not isinstance(args, dict):
        raise Invalid("arguments are not an object")
    return RawCall(name, args)


def read_json_calls(reader: Reader, names: ToolNames, any_name: bool = True) -> list[RawCall]:
    """A JSON-style call object, or a ``[...]`` list of them (not empty)."""
    c = reader.char(reader.pos)
    if c == "{":
        return [read_call_object(reader, names, any_name)]
    if c != "[":
        raise Invalid("not a call")
    reader.pos += 1
    calls: list[RawCall] = []
    while True:
        c = reader.next_char()
        if c == "]" and calls:
            reader.pos += 1
            return calls
        if c == "," and calls:
            reader.pos += 1
        elif c == "{":
            calls.append(read_call_object(reader, names, any_name))
        else:
            raise Invalid("not a list of calls")


def read_arguments(reader: Reader) -> dict[str, Any]:
    """An arguments object at ``reader.pos``: ``{...}`` (leniently), or a string holding one."""
    c = reader.next_char()
    if c == "{":
        reader.pos += 1
        return dict(reader.read_pairs("}", positional=False))
    if c in ("'", '"'):  # strictly quoted: there is no closer to tell a stray quote by
        m = _STRING.match(reader.text, reader.pos)
        if not m:
            reader.more()
        reader.pos = m.end()
        return object_from_text(unescape(m.group()[1:-1]))
    raise Invalid("no arguments object")
