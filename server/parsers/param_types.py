"""A qwen3_coder parameter's text as JSON, by the type the tool's schema declares for it.

    schema                                              text      JSON
    {"type": "integer"}                                 42        42
    {"anyOf": [{"type": "integer"}, {"type": "null"}]}  42        42     (Pydantic's Optional[int])
    {"anyOf": [{"type": "string"}, {"type": "null"}]}   None      null
    {"type": "string"}                                  null      "null"
    {"type": "array"}                                   ['a', 1]  ["a", 1]
    (no schema, or a value that does not fit)           x         "x"

Leniencies taken from the peers, because real models write them: a nullable parameter takes
`None` for null (Qwen3.5's template renders a past null argument with `| string`, so the model
learns to write None); booleans in any case (`True`); an object or array written as a Python
literal (`{'k': 'v'}`, single quotes) when it is not JSON; and the type names of Python-minded
schemas (`float`, `int`, `bool`, `dict`, `list`). Left out: a JSON string that holds a Python
literal (`"{'k': 1}"` for an object) stays the string it is, and a boolean that is neither true
nor false stays text rather than becoming false (vLLM's choices).
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

_INTEGER = re.compile(r"-?\d+")
_PYTHON_LITERAL_LIMIT = 1 << 16  # characters; literal_eval parses, it does not scan
_ALIASES = {
    "int": "integer",
    "float": "number",
    "double": "number",
    "bool": "boolean",
    "dict": "object",
    "list": "array",
}


def declared_types(schema: Any) -> tuple[str, ...]:
    """The JSON types a property's schema allows, in the order written: its "type" (a name or
    a list of names), else the types of its anyOf / oneOf branches. A schema bounded in depth by
    the request body's nesting limit, so the recursion is too."""
    if not isinstance(schema, dict):
        return ()
    written = schema.get("type")
    if isinstance(written, str):
        names = [written]
    elif isinstance(written, list):
        names = [name for name in written if isinstance(name, str)]
    else:
        branches = schema.get("anyOf") or schema.get("oneOf")
        branches = branches if isinstance(branches, list) else []
        return tuple(kind for branch in branches for kind in declared_types(branch))
    return tuple(_ALIASES.get(name.lower(), name.lower()) for name in names)


def typed_value(value: str, types: tuple[str, ...]) -> str:
    """`value` as JSON of the first declared type it fits; a string when a string is allowed,
    when none fits, or when no type is declared."""
    stripped = value.strip()
    if "null" in types and stripped.lower() in ("null", "none"):
        return "null"
    if "string" in types:
        return json.dumps(value, ensure_ascii=False)
    for kind in types:
        typed = _as_kind(stripped, kind)
        if typed is not None:
            return typed
    return json.dumps(value, ensure_ascii=False)


def _as_kind(text: str, kind: str) -> str | None:
    if kind == "integer" and _INTEGER.fullmatch(text) and len(text) < 4000:
        return str(int(text))
    if kind == "number":
        try:
            number = float(text)
        except ValueError:
            return None
        if math.isfinite(number):
            return json.dumps(int(number) if number.is_integer() else number)
    if kind == "boolean" and text.lower() in ("true", "false"):
        return text.lower()
    if kind in ("object", "array"):
        container = dict if kind == "object" else list
        parsed = _json_or_python_literal(text)
        if isinstance(parsed, container):
            try:
                return json.dumps(parsed, ensure_ascii=False, allow_nan=False)
            except (TypeError, ValueError, RecursionError):  # a set, bytes, NaN, too deep
                return None
    return None


def _json_or_python_literal(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        pass
    if len(text) > _PYTHON_LITERAL_LIMIT:
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
