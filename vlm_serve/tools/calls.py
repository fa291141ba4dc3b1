"""What every format shares about a call: declared names, argument objects, JSON calls."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Union

from .types import RawCall
from .values import Invalid, Reader, object_from_text

#: What parsers accept as ``tool_names``: None (nothing declared), the declared function
#: names, or a mapping name -> parameter names in declaration order (used to name
#: positional arguments; see :func:`tool_signatures`).
ToolNamesSpec = Union[None, Collection[str], Mapping[str, Sequence[str]]]

#: Keys a JSON-style call object may have at its top level.
CALL_OBJECT_KEYS = frozenset({"name", "arguments", "parameters", "args", "function", "type", "id"})
_ARGUMENT_KEYS = ("arguments", "parameters", "args")
_NAMESPACES = ("default_api.", "functions.")


class ToolNames:
    """The request's declared functions, as far as parsing needs them."""

    def __init__(self, spec: ToolNamesSpec = None):
        if isinstance(spec, str):
            spec = [spec]
        if isinstance(spec, ToolNames):
            self.declared, self._params = spec.declared, spec._params
        elif spec is None:
            self.declared: frozenset[str] | None = None
            self._params: dict[str, list[str]] = {}
        elif isinstance(spec, Mapping):
            self.declared = frozenset(spec)
            self._params = {name: list(params or ()) for name, params in spec.items()}
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


def tool_signatures(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, list[str]] | None:
    """``tool_names`` for parsers from an OpenAI ``tools`` list: name -> parameter names."""
    if not tools:
        return None
    out: dict[str, list[str]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = list(props) if isinstance(props, Mapping) else []
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
