"""Which JSON Schema keywords the grammar engine enforces, and the first one in a schema that
it would not.

xgrammar (0.2) turns a schema into a grammar and drops what it cannot express, with only a
log warning: an output the grammar accepts could then break the schema. Its converter reads one
"head" keyword per schema object, the first present of $ref, const, enum, anyOf, oneOf, allOf,
and ignores every other constraint there; without a head it reads `type` (or infers an object
from `properties`, an array from `items`), and for strings only the first of format, pattern,
minLength/maxLength. The rules below refuse every case where that would drop a constraint.
Keywords outside the JSON Schema vocabulary are ignored, as any validator ignores them.
"""

from __future__ import annotations

import json
from itertools import combinations
from typing import Any

NEVER_ENFORCED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "contentSchema",
    "$anchor",
    "$dynamicRef",
    "$dynamicAnchor",
    "$recursiveRef",
    "$recursiveAnchor",
)
HEADS = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")  # the converter's precedence
OBJECT_KEYWORDS = frozenset(
    {
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
    }
)
ARRAY_KEYWORDS = frozenset(
    {"items", "prefixItems", "unevaluatedItems", "minItems", "maxItems", "uniqueItems"}
)
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
)
CONSTRAINTS = (
    frozenset({"type"}) | OBJECT_KEYWORDS | ARRAY_KEYWORDS | STRING_KEYWORDS | NUMBER_KEYWORDS
)
STRING_FORMATS = frozenset(
    {
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
MAX_INTEGER_MULTIPLE = 1024  # the converter ignores a larger integer multipleOf

_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items")


def unenforced_keyword(root: Any) -> str | None:
    """ "at PATH: WHY" for the first keyword of `root` that would not be enforced, else None.
    `root` has passed the metaschema check (keyword values have their types)."""
    stack: list[tuple[str, Any]] = [("", root)]
    while stack:  # iterative: a schema may nest as deep as a request allows
        path, schema = stack.pop()
        if not isinstance(schema, dict):
            continue  # true / false
        problem = _problem(schema, root)
        if problem is not None:
            return f"at {path or '/'}: {problem}"
        for key in _SUBSCHEMA_MAPS:
            for name, sub in schema.get(key, {}).items():
                stack.append((f"{path}/{key}/{name}", sub))
        for key in _SUBSCHEMA_LISTS:
            for index, sub in enumerate(schema.get(key, [])):
                stack.append((f"{path}/{key}/{index}", sub))
        for key in (*_SUBSCHEMAS, "unevaluatedItems"):
            if key in schema:
                stack.append((f"{path}/{key}", schema[key]))
    return None


def _constraints(schema: dict) -> list[str]:
    # uniqueItems: false asks for nothing
    return [k for k in schema if k in CONSTRAINTS and not (k == "uniqueItems" and not schema[k])]


def _problem(schema: dict, root: Any) -> str | None:
    for keyword in NEVER_ENFORCED:
        if keyword in schema:
            return f"'{keyword}' is not enforced by the grammar engine"
    if schema.get("uniqueItems") is True:
        return "'uniqueItems' is not enforced by the grammar engine"
    heads = [k for k in HEADS if k in schema]
    if not heads:
        return _typed_problem(schema)
    head = heads[0]
    allowed = {"type"} if head in ("const", "enum") else set()
    ignored = [k for k in heads[1:] + _constraints(schema) if k not in allowed]
    if ignored:
        return (
            f"'{ignored[0]}' next to '{head}' is not enforced (the grammar engine reads only "
            f"'{head}' there)"
        )
    if head == "$ref":
        uri = schema["$ref"]
        if uri != "#" and not uri.startswith("#/"):
            return f"only local references ('#' or '#/...') are resolved, not {uri!r}"
    elif head in ("const", "enum") and "type" in schema:
        types = _types(schema)
        values = [schema["const"]] if head == "const" else schema["enum"]
        for value in values:
            if not any(_is_type(value, t) for t in types):
                return (
                    f"{head} value {json.dumps(value)} is not of type {json.dumps(schema['type'])}"
                )
    elif head == "allOf" and len(schema["allOf"]) > 1:
        return "'allOf' with more than one schema is not enforced by the grammar engine"
    elif head == "oneOf" and not _disjoint(schema["oneOf"], root):
        return (
            "'oneOf' options that may overlap are not enforced (exactly one must match): use "
            "'anyOf', or options of distinct types or with distinct 'const' values of a "
            "required property"
        )
    return None


def _typed_problem(schema: dict) -> str | None:
    types = _types(schema)
    if not types:
        if any(
            k in schema for k in ("properties", "additionalProperties", "unevaluatedProperties")
        ):
            types = ["object"]
        elif any(k in schema for k in ("items", "prefixItems", "unevaluatedItems")):
            types = ["array"]
        else:
            stray = _constraints(schema)
            return f"'{stray[0]}' without a 'type' is not enforced" if stray else None
    if "string" in types:
        fmt = schema.get("format")
        if fmt is not None and fmt not in STRING_FORMATS:
            return f"format {fmt!r} is not enforced (enforced: {', '.join(sorted(STRING_FORMATS))})"
        present = [k for k in ("format", "pattern", "minLength", "maxLength") if k in schema]
        dropped = [k for k in present if k not in ("minLength", "maxLength")][1:] + (
            [k for k in present if k in ("minLength", "maxLength")]
            if {"format", "pattern"} & set(present)
            else []
        )
        if dropped:
            return f"'{dropped[0]}' next to '{present[0]}' is not enforced (one of format, pattern, lengths)"
    if "multipleOf" in schema:
        multiple = schema["multipleOf"]
        if "number" in types:
            return "'multipleOf' is enforced for integers only"
        if "integer" in types and not (
            float(multiple).is_integer() and 0 < multiple <= MAX_INTEGER_MULTIPLE
        ):
            return f"'multipleOf' is enforced for whole numbers up to {MAX_INTEGER_MULTIPLE} only"
    if "object" in types:
        properties = schema.get("properties", {})
        missing = [name for name in schema.get("required", []) if name not in properties]
        if missing:
            return (
                f"required property {missing[0]!r} is not in 'properties' (the grammar engine "
                "would never write it)"
            )
    return None


def _types(schema: dict) -> list[str]:
    kind = schema.get("type")
    return [kind] if isinstance(kind, str) else list(kind or [])


def _is_type(value: Any, kind: str) -> bool:
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer()
        )
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}
    return isinstance(value, python[kind])


# -- oneOf: exactly one option must match, which only disjoint options guarantee ----------------


def _disjoint(options: list, root: Any) -> bool:
    resolved = [_resolve(option, root) for option in options]
    if any(option is None for option in resolved):
        return False
    finite = [_finite_values(option) for option in resolved]
    if all(values is not None for values in finite):
        return all(not (a & b) for a, b in combinations(finite, 2))
    families = [_type_family(option) for option in resolved]
    if all(families) and len(set(families)) == len(families):
        return True
    return _discriminated(resolved)


def _resolve(schema: Any, root: Any) -> dict | None:
    """A local $ref followed (a few hops); None when it is not a plain local pointer."""
    for _ in range(8):
        if not isinstance(schema, dict):
            return None
        uri = schema.get("$ref")
        if uri is None:
            return schema
        if uri == "#":
            schema = root
            continue
        if not uri.startswith("#/"):
            return None
        node = root
        for part in uri[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        schema = node
    return None


def _finite_values(schema: dict) -> set[str] | None:
    if "const" in schema:
        return {_canonical(schema["const"])}
    if "enum" in schema:
        return {_canonical(value) for value in schema["enum"]}
    return None


def _canonical(value: Any) -> str:
    """Equal JSON values give equal strings (1 and 1.0 alike; true and 1 apart)."""

    def normal(v: Any) -> Any:
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if isinstance(v, dict):
            return {k: normal(x) for k, x in v.items()}
        if isinstance(v, list):
            return [normal(x) for x in v]
        return v

    return json.dumps(normal(value), sort_keys=True)


def _type_family(schema: dict) -> str | None:
    """The one JSON type a headless schema admits (integer and number are one family)."""
    if any(k in schema for k in HEADS):
        return None
    types = _types(schema)
    if len(types) != 1:
        return None
    return "number" if types[0] == "integer" else types[0]


def _discriminated(options: list[dict]) -> bool:
    """Every option an object that requires one same property, with pairwise disjoint const or
    enum values for it (Pydantic's discriminated unions)."""
    first = options[0]
    for key in first.get("required", []):
        values = []
        for option in options:
            prop = option.get("properties", {}).get(key)
            if key not in option.get("required", []) or not isinstance(prop, dict):
                break
            finite = _finite_values(prop)
            if finite is None:
                break
            values.append(finite)
        else:
            if all(not (a & b) for a, b in combinations(values, 2)):
                return True
    return False
