"""`oneOf`: a value must meet exactly one option, which a grammar can only promise when no
value it writes for one option meets another. The options are then alternatives (anyOf).

`exclusive` proves it branch by branch: a branch written for option i is kept when it fails
every other option, judged against the option as given (not as narrowed); a branch that cannot
be proven so is left out (a narrowing), and a oneOf with none left is refused. A branch fails
an option when

* its values (const / enum) are all invalid there (the validator says);
* the types it is written as are none of the types the option asserts;
* it is written as an object and the option requires a property the branch never writes, or
  forbids one it always writes, or holds it to values the branch never gives it.

Pydantic's discriminated unions, `[string, null]` pairs and variants that differ in a required
property all pass; options that may overlap are refused ('anyOf' says the same and is enforced).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from baton.engine.structured_output.schema.conjunction import ALL_TYPES, Flat, canonical, flat_of
from baton.engine.structured_output.schema.document import Node, Unenforceable
from baton.engine.structured_output.schema.values import type_of

if TYPE_CHECKING:
    from baton.engine.structured_output.schema.lower import Lowering

_DEPTH = 16  # $ref hops followed when reading what an option asserts


def exclusive(lowering: Lowering, node: Node, options: list[list[Flat]]) -> list[Flat]:
    """The branches a oneOf may be written as: each option's branches that fail every other
    option (a branch holding a property to values another option refuses is made to write
    it). Unenforceable when none is left."""
    originals = [lowering.child(node, "oneOf", i) for i in range(len(options))]
    kept = []
    for i, branches in enumerate(options):
        others = [other for j, other in enumerate(originals) if j != i]
        for flat in branches:
            candidates = [flat, *_discriminated(lowering, flat), _without(lowering, flat, others)]
            for candidate in filter(None, candidates):
                for other in others:
                    candidate = _fails(lowering, candidate, other)
                    if candidate is None:
                        break
                else:
                    kept.append(candidate)
                    break
    if not kept:
        raise Unenforceable(
            f"{node.path}/oneOf",
            "its options may match the same values, and 'oneOf' needs exactly one to (use "
            "'anyOf', or options of distinct types or with distinct 'const' values of a "
            "required property)",
        )
    return kept


def _discriminated(lowering: Lowering, flat: Flat) -> list[Flat]:
    """The branch made to write a property it holds to const / enum values (a discriminator
    an option may not require), one candidate per such property."""
    names = {name for part in flat.objects for name in part.schema.get("properties") or {}}
    return [
        flat.with_names(required=[name])
        for name in sorted(names - flat.forbidden)
        if _values_of(lowering, flat, name) is not None
    ]


def _without(lowering: Lowering, flat: Flat, others: list[Node]) -> Flat | None:
    """The branch made to leave out a property each other option requires ("exactly one of
    a, b": `[{"required": ["a"]}, {"required": ["b"]}]`); None when an option requires none
    the branch may leave out."""
    always = _always(flat)
    left_out = []
    for other in others:
        required = sorted(_required(lowering, other) - always)
        if not required:
            return None
        left_out.append(required[0])
    return flat.with_names(forbidden=left_out)


def _fails(lowering: Lowering, flat: Flat, option: Node) -> Flat | None:
    """The branch, made to keep what proves that it fails `option` (None: no proof). The
    branch is merged further (with the keywords beside the oneOf, allOf siblings...), which
    may only narrow it, so the proof must not rest on what a merge changes: the types it is
    written as are fixed (implied types would be lost to a `type` beside it), and so is a
    property it must leave out (another subschema might declare it)."""
    if flat.values is not None:  # the values no other option allows (the validator says)
        kept = tuple(v for v in flat.values if not lowering.is_valid(v, option, unknown=True))
        return replace(flat, values=kept) if kept else None
    written = flat.emitted_types()
    fixed = replace(flat, types=written, typed=True)
    if not written & asserted_types(lowering, option, _DEPTH):
        return fixed
    if written <= {"object"}:
        return _object_fails(lowering, fixed, option)
    return None


def asserted_types(lowering: Lowering, node: Node, depth: int) -> frozenset[str]:
    """The types every value valid at `node` has (a superset)."""
    schema = node.schema
    if schema is False:
        return frozenset()
    if not isinstance(schema, dict) or depth == 0:
        return ALL_TYPES
    if "$ref" in schema:
        target = asserted_types(lowering, lowering.resolve(node), depth - 1)
        if _ref_hides_siblings(lowering, schema):
            return target
    own = flat_of(lowering.doc, node)
    types = own.types if own is not None else frozenset()
    if own is not None and own.values is not None:
        types &= frozenset().union(*map(type_of, own.values))
    if "$ref" in schema:
        types &= target
    for index in range(len(schema.get("allOf") or [])):
        types &= asserted_types(lowering, lowering.child(node, "allOf", index), depth - 1)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            union = frozenset().union(
                *(
                    asserted_types(lowering, lowering.child(node, key, i), depth - 1)
                    for i in range(len(schema[key]))
                )
            )
            types &= union
    return types


def _ref_hides_siblings(lowering: Lowering, schema: dict) -> bool:
    """Drafts 3 to 7 validate only the `$ref` of a schema that has one (its siblings are
    ignored): what an option asserts must be read the validator's way."""
    return "$ref" in schema and lowering.doc.draft in ("3", "4", "6", "7")


def _object_fails(lowering: Lowering, flat: Flat, option: Node) -> Flat | None:
    parts = _conjuncts(lowering, option, _DEPTH)
    for name in sorted(_required(lowering, option)):
        if not can_write(flat, name):
            return flat.with_names(forbidden=[name])
    for name in _always(flat):
        for part in parts:
            for node in _property_schemas(lowering, part, name):
                if node is None:  # the option forbids it
                    return flat.with_names(required=[name])
                values = _values_of(lowering, flat, name)
                if values is not None:
                    if not any(lowering.is_valid(v, node, unknown=True) for v in values):
                        return flat.with_names(required=[name])
                elif not _property_types(lowering, flat, name) & asserted_types(
                    lowering, node, _DEPTH
                ):
                    return flat.with_names(required=[name])
    return None


def _required(lowering: Lowering, option: Node) -> set[str]:
    return {
        name
        for part in _conjuncts(lowering, option, _DEPTH)
        for name in (part.schema.get("required") or [])
        if isinstance(name, str)
    }


def _always(flat: Flat) -> set[str]:
    """The properties every object of the branch has."""
    names = set(flat.required)
    for part in flat.objects:
        if isinstance(part.schema.get("required"), list):
            names |= set(part.schema["required"])
    return names


def _property_schemas(lowering: Lowering, part: Node, name: str) -> list[Node | None]:
    """What subschema `part` holds property `name` to ([None]: it forbids the name)."""
    schema = part.schema
    found = []
    if name in (schema.get("properties") or {}):
        found.append(lowering.child(part, "properties", name))
    for pattern in schema.get("patternProperties") or {}:
        if re.search(pattern, name):
            found.append(lowering.child(part, "patternProperties", pattern))
    if not found:
        later = schema.get("additionalProperties")
        if later is False:
            return [None]
        if isinstance(later, dict):
            found.append(lowering.child(part, "additionalProperties"))
    return found


def _property_types(lowering: Lowering, flat: Flat, name: str) -> frozenset[str]:
    """The types a branch writes property `name` as (a superset)."""
    types = ALL_TYPES
    for part in flat.objects:
        for node in _property_schemas(lowering, part, name):
            if node is not None:
                types &= asserted_types(lowering, node, _DEPTH)
    return types


def can_write(flat: Flat, name: str) -> bool:
    """Whether the branch may write property `name` (containers.py's rules: a forbidden name
    never; beyond the declared ones, only where the branch writes other properties)."""
    if name in flat.forbidden:
        return False
    declared = set(flat.required)
    others = False
    for part in flat.objects:
        schema = part.schema
        declared |= set(schema.get("properties") or {})
        if isinstance(schema.get("required"), list):
            declared |= set(schema["required"])
        if any(
            schema.get(k) not in (None, False)
            for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")
        ):
            others = True
        if schema.get("minProperties", 0) > 0:
            others = True
    return name in declared or others


def _conjuncts(lowering: Lowering, node: Node, depth: int) -> list[Node]:
    """`node` and the subschemas it meets whole ($ref target, allOf members), as dicts."""
    if not isinstance(node.schema, dict) or depth == 0:
        return []
    if "$ref" in node.schema:
        target = _conjuncts(lowering, lowering.resolve(node), depth - 1)
        if _ref_hides_siblings(lowering, node.schema):
            return target
    found = [node] + (target if "$ref" in node.schema else [])
    for index in range(len(node.schema.get("allOf") or [])):
        found += _conjuncts(lowering, lowering.child(node, "allOf", index), depth - 1)
    return found


def _values_of(lowering: Lowering, flat: Flat, name: str) -> list[Any] | None:
    """The const / enum values a branch holds property `name` to (None: not a finite set)."""
    found = None
    for part in flat.objects:
        if name not in (part.schema.get("properties") or {}):
            continue
        node = lowering.child(part, "properties", name)
        for _ in range(_DEPTH):
            if not (isinstance(node.schema, dict) and set(node.schema) == {"$ref"}):
                break
            node = lowering.resolve(node)
        own = flat_of(lowering.doc, node) if isinstance(node.schema, dict) else None
        if own is not None and own.values is not None:
            keys = {canonical(value) for value in own.values}
            found = [
                v for v in (found if found is not None else own.values) if canonical(v) in keys
            ]
    return found
