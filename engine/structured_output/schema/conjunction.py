"""One branch of a schema: what the keywords of several subschemas ask of a value together.

A schema's value must meet its own keywords, its `allOf` members, its `$ref`'s target and one
option of each `anyOf` / `oneOf`. lower.py expands a schema into branches (a list of Flat, any
one of which a value may follow); a Flat merges its subschemas' keywords: types intersect,
bounds tighten, const / enum values intersect. Object and array keywords stay with the
subschemas that gave them (`objects`, `arrays`): which property a name falls under depends on
each subschema's own properties, patternProperties and additionalProperties, read at emission.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from baton.engine.structured_output.schema.document import Document, Node

# "number" is "integer" or "fraction": intersections are then plain set intersections.
ALL_TYPES = frozenset({"null", "boolean", "object", "array", "string", "integer", "fraction"})
_TYPE_SETS = {
    "null": {"null"},
    "boolean": {"boolean"},
    "object": {"object"},
    "array": {"array"},
    "string": {"string"},
    "integer": {"integer"},
    "number": {"integer", "fraction"},
    "any": set(ALL_TYPES),  # draft 3
}
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
    {
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "minItems",
        "maxItems",
        "uniqueItems",
        "contains",
    }
)
STRING_KEYWORDS = frozenset({"minLength", "maxLength", "pattern", "format"})
NUMBER_KEYWORDS = frozenset(
    {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "divisibleBy"}
)

# Keywords that constrain a value (any draft); every other key is an annotation or a location.
CONSTRAINTS = frozenset(
    {
        "type",
        "enum",
        "const",
        "$ref",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
        "dependencies",
        "dependentRequired",
        "dependentSchemas",
        "extends",
        "disallow",
        "$recursiveRef",
        "$dynamicRef",
        "properties",
        "required",
        "additionalProperties",
        "unevaluatedProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "minItems",
        "maxItems",
        "uniqueItems",
        "contains",
        "minContains",
        "maxContains",
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
        "divisibleBy",
    }
)

Bound = tuple[float, bool]  # (value, exclusive)


@dataclass(frozen=True)
class Flat:
    sources: tuple[Node, ...] = ()  # the subschemas a value of this branch meets together
    types: frozenset[str] = ALL_TYPES
    typed: bool = False  # some source says `type` (else the types are implied by keywords)
    values: tuple[Any, ...] | None = None  # const / enum candidates
    lower: Bound | None = None
    upper: Bound | None = None
    multiples: tuple[tuple[str, float], ...] = ()  # (path, multipleOf)
    min_length: int = 0
    max_length: int | None = None
    patterns: tuple[tuple[str, str], ...] = ()  # (path, pattern)
    formats: tuple[str, ...] = ()
    objects: tuple[Node, ...] = ()  # subschemas with object keywords
    arrays: tuple[Node, ...] = ()  # subschemas with array keywords
    required: frozenset[str] = frozenset()  # beyond the objects' own `required`
    forbidden: frozenset[str] = frozenset()  # property names this branch must not write
    excluded: tuple[tuple[str, Any], ...] = ()  # (property, a value it must not have)
    keywords: frozenset[str] = field(default=frozenset())  # which families have keywords
    # keywords (a `not` no branch expresses) only the validator checks: enforced when the
    # branch is const / enum values (each one validated), else refused
    unchecked: tuple[str, ...] = ()

    def merge(self, other: Flat) -> Flat | None:
        """Both branches at once; None when no value can meet both (types or values)."""
        types = self.types & other.types
        values = _intersect(self.values, other.values)
        if not types or values == ():
            return None
        return Flat(
            sources=self.sources + other.sources,
            types=types,
            typed=self.typed or other.typed,
            values=values,
            lower=_tighter(self.lower, other.lower, max),
            upper=_tighter(self.upper, other.upper, min),
            multiples=self.multiples + other.multiples,
            min_length=max(self.min_length, other.min_length),
            max_length=_least(self.max_length, other.max_length),
            patterns=tuple(dict.fromkeys(self.patterns + other.patterns)),
            formats=tuple(dict.fromkeys(self.formats + other.formats)),
            objects=self.objects + other.objects,
            arrays=self.arrays + other.arrays,
            required=self.required | other.required,
            forbidden=self.forbidden | other.forbidden,
            excluded=self.excluded + other.excluded,
            keywords=self.keywords | other.keywords,
            unchecked=self.unchecked + other.unchecked,
        )

    def with_names(self, required=(), forbidden=(), excluded=()) -> Flat:
        return replace(
            self,
            required=self.required | frozenset(required),
            forbidden=self.forbidden | frozenset(forbidden),
            excluded=self.excluded + tuple(excluded),
            keywords=self.keywords | {"object"},
        )

    def hopeless(self) -> bool:
        """A cheap proof that no object meets the branch (and it is one): a name both required
        and forbidden, or required and held to values that exclude each other. Branches are
        multiplied (each `if` of an allOf: two or more): these are dropped as they appear."""
        if self.values is not None or self.emitted_types() != frozenset({"object"}):
            return False
        required = set(self.required)
        for part in self.objects:
            if isinstance(part.schema.get("required"), list):
                required |= set(part.schema["required"])
        if required & self.forbidden:
            return True
        for name in required:
            held = None
            for part in self.objects:
                sub = (part.schema.get("properties") or {}).get(name)
                if isinstance(sub, dict) and ("const" in sub or "enum" in sub):
                    values = {canonical(v) for v in sub.get("enum", [sub.get("const")])}
                    if "const" in sub:
                        values &= {canonical(sub["const"])}
                    held = values if held is None else held & values
            if held is not None:
                held -= {canonical(value) for n, value in self.excluded if n == name}
                if not held:
                    return True
        return False

    def emitted_types(self) -> frozenset[str]:
        """The types a value of this branch is written as: those `type` allows, narrowed to
        the families the branch has keywords for when no `type` was given (a schema with only
        `minLength` asks nothing of numbers, but a string is what it means)."""
        if self.typed or not self.keywords:
            return self.types
        implied = set()
        for family in self.keywords:
            implied |= {"number": {"integer", "fraction"}}.get(family, {family})
        return self.types & frozenset(implied) or self.types


def flat_of(doc: Document, node: Node) -> Flat | None:
    """The branch of one subschema's own keywords (its combinators are lower.py's); None when
    no value can meet them."""
    schema = node.schema
    if schema is True or schema == {}:
        return Flat(sources=(node,))
    if schema is False:
        return None
    types = ALL_TYPES
    kind = schema.get("type")  # (draft 3's list of types and schemas is lower.py's union)
    union = doc.draft == "3" and isinstance(kind, list) and any(isinstance(k, dict) for k in kind)
    typed = kind is not None and not union
    if typed:
        names = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        types = frozenset().union(*(_TYPE_SETS.get(name, set()) for name in names))
    values = None
    if "const" in schema:
        values = (schema["const"],)
    if "enum" in schema:
        values = _intersect(values, tuple(schema["enum"]))
    if values == () or not types:
        return None
    keywords = set()
    if OBJECT_KEYWORDS & schema.keys() or (doc.draft == "3" and _draft3_required(schema)):
        keywords.add("object")
    if ARRAY_KEYWORDS & schema.keys():
        keywords.add("array")
    if STRING_KEYWORDS & schema.keys():
        keywords.add("string")
    if NUMBER_KEYWORDS & schema.keys():
        keywords.add("number")
    lower, upper = _bounds(schema, doc.draft)
    multiples = tuple(
        (f"{node.path}/{key}", schema[key])
        for key in ("multipleOf", "divisibleBy")
        if key in schema
    )
    pattern = schema.get("pattern")
    fmt = schema.get("format")
    return Flat(
        sources=(node,),
        types=types,
        typed=typed,
        values=values,
        lower=lower,
        upper=upper,
        multiples=multiples,
        min_length=count_of(schema, "minLength", 0),
        max_length=count_of(schema, "maxLength", None),
        patterns=((f"{node.path}/pattern", pattern),) if isinstance(pattern, str) else (),
        formats=(fmt,) if isinstance(fmt, str) else (),
        objects=(node,) if "object" in keywords else (),
        arrays=(node,) if "array" in keywords else (),
        keywords=frozenset(keywords),
    )


def _draft3_required(schema: dict) -> bool:
    properties = schema.get("properties")
    return isinstance(properties, dict) and any(
        isinstance(sub, dict) and sub.get("required") is True for sub in properties.values()
    )


def _bounds(schema: dict, draft: str) -> tuple[Bound | None, Bound | None]:
    """(lower, upper): draft 3/4 say `exclusiveMinimum: true` beside `minimum`, later drafts
    give exclusiveMinimum its own number."""
    lower = upper = None
    if "minimum" in schema:
        lower = (schema["minimum"], schema.get("exclusiveMinimum") is True)
    if "maximum" in schema:
        upper = (schema["maximum"], schema.get("exclusiveMaximum") is True)
    if draft not in ("3", "4"):
        if _is_number(schema.get("exclusiveMinimum")):
            lower = _tighter(lower, (schema["exclusiveMinimum"], True), max)
        if _is_number(schema.get("exclusiveMaximum")):
            upper = _tighter(upper, (schema["exclusiveMaximum"], True), min)
    return lower, upper


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _tighter(a: Bound | None, b: Bound | None, pick) -> Bound | None:
    if a is None or b is None:
        return a or b
    if a[0] == b[0]:
        return (a[0], a[1] or b[1])
    return a if pick(a[0], b[0]) == a[0] else b


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def count_of(schema: dict, key: str, default: int | None) -> int | None:
    """A count keyword's value as an int (drafts 6+ allow 2.0; the grammar engine takes 2)."""
    value = schema.get(key)
    return default if value is None else int(value)


def canonical(value: Any) -> str:
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


def _intersect(a: tuple | None, b: tuple | None) -> tuple | None:
    if a is None or b is None:
        return a if b is None else b
    keys = {canonical(value) for value in b}
    return tuple(value for value in a if canonical(value) in keys)
