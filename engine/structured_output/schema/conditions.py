"""The keywords that make a schema's branches depend on a value: dependencies (a property
that brings others along), if / then / else, and `not` where its negation can be written.

Each is a list of branches (Flat) the schema's own are multiplied with (lower.py):

    dependencies {a: [b]}          a absent  |  a, b present
    dependentSchemas {a: S}        a absent  |  a present, and S
    if I then T else E             I and T   |  not I, and E     (not I: see `negation`)
    not N                          not N

`negation` writes the values a schema refuses where that is a type (the other types), a
`required` list (one of its properties absent), or anyOf / allOf / $ref of those; any other
negation is not expressible (an `if` then keeps its `then` branch alone, a narrowing; a `not`
is enforced only over const / enum values, each one validated).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from baton.engine.structured_output.schema.conjunction import (
    ALL_TYPES,
    CONSTRAINTS,
    Flat,
    canonical,
    flat_of,
)
from baton.engine.structured_output.schema.document import Empty, Node
from baton.engine.structured_output.schema.patterns import PatternError, excluding_regex

if TYPE_CHECKING:
    from baton.engine.structured_output.schema.lower import Lowering


def dependencies(lowering: Lowering, node: Node) -> list[list[Flat]]:
    """Each dependency as two branches: its property absent, or present with the names
    (dependentRequired) or the schema (dependentSchemas) it brings."""
    schema = node.schema
    required = (
        set(schema.get("required") or []) if isinstance(schema.get("required"), list) else set()
    )
    found = []
    for key in ("dependencies", "dependentRequired", "dependentSchemas"):
        for name, dependency in (schema.get(key) or {}).items():
            present = Flat(sources=(node,)).with_names(required=[name])
            if isinstance(dependency, str):  # (draft 3: one name)
                dependency = [dependency]
            if isinstance(dependency, list):
                branches = [present.with_names(required=dependency)]
            else:
                branches = [
                    m
                    for flat in lowering.expand_one(lowering.child(node, key, name))
                    if (m := present.merge(flat)) is not None
                ]
            if name not in required:
                branches.append(Flat(sources=(node,)).with_names(forbidden=[name]))
            found.append(branches)
    return found


def condition(lowering: Lowering, node: Node) -> list[Flat]:
    """if/then/else: the `if` branch with `then`; the other side only where the `if` is a
    type or a `required` list, whose negation is a type or an absent property."""
    schema = node.schema
    condition = lowering.child(node, "if")
    then = [lowering.child(node, "then")] if "then" in schema else []
    branches = lowering.expand([condition, *then])
    negated = negation(lowering, condition, depth=8)
    if negated is not None:
        otherwise = (
            lowering.expand_one(lowering.child(node, "else")) if "else" in schema else [Flat()]
        )
        branches += [m for a in negated for b in otherwise if (m := a.merge(b)) is not None]
    return branches


def negation(lowering: Lowering, node: Node, depth: int) -> list[Flat] | None:
    """Branches for the values `node` refuses, where they can be written: nothing for a
    schema that allows anything, other types for a `type`, an absent property for
    `required`, and anyOf / allOf / $ref of those (None: not expressible)."""
    schema = node.schema
    if schema is False:
        return [Flat()]
    keys = {key for key in schema if key in CONSTRAINTS} if isinstance(schema, dict) else set()
    if not keys or depth == 0:
        return [] if not keys else None
    if keys == {"required"}:  # (a value that is no object meets any `required`)
        return [_object(node).with_names(forbidden=[name]) for name in schema["required"]]
    if keys == {"type"}:
        own = flat_of(lowering.doc, node)
        others = ALL_TYPES - own.types if own is not None else ALL_TYPES
        return [Flat(typed=True, types=others)] if others else []
    if keys == {"$ref"}:
        return negation(lowering, lowering.resolve(node), depth - 1)
    if "properties" in keys and keys <= {"properties", "required"}:
        return _property_negation(lowering, node)
    if keys == {"anyOf"}:  # none of the options: each one's negation, together
        flats = [Flat()]
        for index in range(len(schema["anyOf"])):
            negated = negation(lowering, lowering.child(node, "anyOf", index), depth - 1)
            if negated is None:
                return None
            flats = lowering._product(flats, negated, node.path)
        return flats
    if keys == {"allOf"}:  # not all of them: any one's negation
        found = []
        for index in range(len(schema["allOf"])):
            negated = negation(lowering, lowering.child(node, "allOf", index), depth - 1)
            if negated is None:
                return None
            found += negated
        return found
    return None


def _property_negation(lowering: Lowering, node: Node) -> list[Flat] | None:
    """Not {properties: {p: const / enum}, required: [...]} (JSON Schema Store's `if`s): an
    object that lacks a required property, or has p with another value."""
    schema = node.schema
    branches = [_object(node).with_names(forbidden=[name]) for name in schema.get("required", [])]
    for name in schema["properties"]:
        sub = lowering.child(node, "properties", name)
        while isinstance(sub.schema, dict) and set(sub.schema) & CONSTRAINTS == {"$ref"}:
            sub = lowering.resolve(sub)
        keys = set(sub.schema) & CONSTRAINTS if isinstance(sub.schema, dict) else {"?"}
        own = flat_of(lowering.doc, sub) if not keys - {"const", "enum", "type"} else None
        if own is None or own.values is None:
            return None  # (p of a type, a pattern...: its negation is no const / enum)
        values = [v for v in own.values if lowering.is_valid(v, sub, unknown=True)]
        excluded = [(name, value) for value in values]
        branches.append(_object(node).with_names(required=[name], excluded=excluded))
    return branches


def _object(node: Node) -> Flat:
    """A branch of objects only: what a negation of object keywords leaves (any value that
    is no object meets `properties` and `required`)."""
    return Flat(sources=(node,), types=frozenset({"object"}), typed=True)


def without_values(lowering: Lowering, lowered: Any, values: list[Any], path: str) -> Any:
    """A lowered schema that admits what `lowered` does but `values` (Empty when that cannot be
    written: a number or an object held off one value, a pattern and a value...)."""
    if isinstance(lowered, dict) and "$ref" in lowered:
        shared = lowering.defs.get(lowered["$ref"].rsplit("/", 1)[1])
        if shared is None:  # (still being written: a recursive position)
            raise Empty(path, "a value held off given values inside its own recursion")
        lowered = dict(shared)
    keys = {canonical(value) for value in values}
    if "const" in lowered or "enum" in lowered:
        kept = [v for v in lowered.get("enum", [lowered.get("const")]) if canonical(v) not in keys]
        if not kept:
            raise Empty(path, "no value is left beside an excluded one")
        return {"const": kept[0]} if len(kept) == 1 else {"enum": kept}
    if "anyOf" in lowered or isinstance(lowered.get("type"), list):
        options = lowered.get("anyOf") or [{"type": kind} for kind in lowered["type"]]
        kept = []
        for option in options:
            try:
                kept.append(without_values(lowering, option, values, path))
            except Empty:
                continue
        if not kept:
            raise Empty(path, "no value is left beside an excluded one")
        return kept[0] if len(kept) == 1 else {"anyOf": kept}
    kind = lowered.get("type")
    hit = [v for v in values if _is_of(v, kind)]
    if not hit:
        return lowered
    if kind == "boolean":
        kept = [b for b in (True, False) if canonical(b) not in keys]
        if not kept:
            raise Empty(path, "no boolean is left beside the excluded ones")
        return {"const": kept[0]}
    if kind == "string" and set(lowered) <= {"type", "minLength", "maxLength"}:
        low, high = lowered.get("minLength", 0), lowered.get("maxLength", float("inf"))
        try:
            return {"type": "string", "pattern": excluding_regex(set(hit), low, high)}
        except PatternError:
            raise Empty(path, "no string is left beside the excluded ones") from None
    raise Empty(path, f"a {kind or 'value of any type'} held off given values is not written")


def _is_of(value: Any, kind: str | None) -> bool:
    if kind is None:
        return True
    if kind in ("integer", "number"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    python = {"string": str, "boolean": bool, "null": type(None), "object": dict, "array": list}
    return isinstance(value, python[kind])
