"""A small JSON Schema checker for tests (the subset tool parameters use; no jsonschema
package here): the errors of ``value`` against ``schema``, [] when it conforms."""

from __future__ import annotations

from typing import Any

_TYPES = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
}


def schema_errors(value: Any, schema: Any, root: Any = None, at: str = "$") -> list[str]:
    root = schema if root is None else root
    if not isinstance(schema, dict):
        return []
    if "$ref" in schema:
        target = root
        for part in schema["$ref"][2:].split("/"):
            target = target[part]
        return schema_errors(value, target, root, at)
    errors: list[str] = []
    if "const" in schema and value != schema["const"]:
        errors.append(f"{at}: {value!r} is not {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{at}: {value!r} not in {schema['enum']!r}")
    for key in ("anyOf", "oneOf"):
        if key in schema and all(schema_errors(value, b, root, at) for b in schema[key]):
            errors.append(f"{at}: matches none of {key}")
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else list(kinds)
        if schema.get("nullable"):
            kinds.append("null")
        if not any(_TYPES[k](value) for k in kinds):
            return errors + [f"{at}: {value!r} is not of type {kinds}"]
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)) or len(value) < schema.get("minLength", 0):
            errors.append(f"{at}: length {len(value)} out of bounds")
    if _TYPES["number"](value):
        if value < schema.get("minimum", value) or value > schema.get("maximum", value):
            errors.append(f"{at}: {value} out of range")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)) or len(value) < schema.get("minItems", 0):
            errors.append(f"{at}: {len(value)} items out of bounds")
        for i, item in enumerate(value):
            errors += schema_errors(item, schema.get("items"), root, f"{at}[{i}]")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{at}: missing {k!r}" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{at}: unexpected {k!r}" for k in value if k not in props]
        for k, v in value.items():
            errors += schema_errors(v, props.get(k), root, f"{at}.{k}")
    return errors
