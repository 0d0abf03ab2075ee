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

from typing import TYPE_CHECKING

from baton.engine.structured_output.schema.conjunction import ALL_TYPES, CONSTRAINTS, Flat, flat_of
from baton.engine.structured_output.schema.document import Node

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
    if keys == {"required"}:
        return [Flat(sources=(node,)).with_names(forbidden=[name]) for name in schema["required"]]
    if keys == {"type"}:
        own = flat_of(lowering.doc, node)
        others = ALL_TYPES - own.types if own is not None else ALL_TYPES
        return [Flat(typed=True, types=others)] if others else []
    if keys == {"$ref"}:
        return negation(lowering, lowering.resolve(node), depth - 1)
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
