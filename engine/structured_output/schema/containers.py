"""Arrays and objects of one branch, written from the subschemas that shaped them.

A branch may hold several subschemas with object keywords (a schema and its allOf members).
Each property name is what every one of them says of it: its `properties` entry, the
`patternProperties` that match it, else its `additionalProperties` (false: the name may not
be written). Properties beyond the declared ones are written only as every subschema allows;
with the server's strict reading (no property or item beyond the schema's), a subschema that
says nothing adds none. The same holds per position for arrays (`prefixItems` or a draft-4
`items` list, then `items` / `additionalItems`).

What the grammar engine could write but the schema forbids is narrowed away: a declared name
that also matches a pattern meets both schemas; pattern keys take every pattern's schema (a key
may match several); `contains` makes the first items meet its schema.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from baton.engine.structured_output.schema.conditions import without_values
from baton.engine.structured_output.schema.conjunction import Flat, count_of
from baton.engine.structured_output.schema.document import Empty, Node, Unenforceable
from baton.engine.structured_output.schema.patterns import (
    PatternError,
    excluding_regex,
    json_string_regex,
)

if TYPE_CHECKING:
    from baton.engine.structured_output.schema.lower import Lowering


# -- arrays -------------------------------------------------------------------------------------


def write_array(lowering: Lowering, flat: Flat) -> dict:
    legacy = lowering.doc.draft != "2020-12"
    positions: list[list[Node]] = []  # prefix position -> the subschemas its item meets
    # per array subschema: (its prefix length, what its later items meet: Node, False, None)
    rest: list[tuple[int, Node | bool | None]] = []
    low, high, unique, contains = 0, None, None, []
    for node in flat.arrays:
        schema = node.schema
        items = schema.get("items")
        if legacy and isinstance(items, list):
            prefix = [lowering.child(node, "items", i) for i in range(len(items))]
            later = _subschema(lowering, node, "additionalItems")
        else:
            count = 0 if legacy else len(schema.get("prefixItems") or [])
            prefix = [lowering.child(node, "prefixItems", i) for i in range(count)]
            later = _subschema(lowering, node, "items")
        if later is None:
            later = _subschema(lowering, node, "unevaluatedItems")
        for index, item in enumerate(prefix):
            if index == len(positions):
                positions.append([])
            positions[index].append(item)
        rest.append((len(prefix), later))
        low = max(low, count_of(schema, "minItems", 0))
        high = _least(high, count_of(schema, "maxItems", None))
        if schema.get("uniqueItems") is True:
            unique = f"{node.path}/uniqueItems"
        if "contains" in schema and count_of(schema, "minContains", 1) > 0:
            contains.append((lowering.child(node, "contains"), count_of(schema, "minContains", 1)))
    need = max((count for _, count in contains), default=0)
    low = max(low, need)
    positions += [[] for _ in range(need - len(positions))]
    for index, items in enumerate(positions):  # past its own prefix, a subschema's later items
        for prefix_length, later in rest:
            if index >= prefix_length:
                if later is False:
                    high = _least(high, index)
                elif later is not None:
                    items.append(later)
    for node, count in contains:  # `contains`: the first items meet it
        for index in range(count):
            positions[index].append(node)
    if unique is not None and (high is None or high > 1):
        raise Unenforceable(
            unique, "'uniqueItems' is not enforced (a grammar cannot compare items)"
        )
    prefix_written: list[Any] = []
    for index, items in enumerate(positions[:high]):
        try:
            prefix_written.append(lowering.schema(items) if items else {})
        except Empty:
            if index < low:
                raise
            high = index  # no item can stand here: the array ends before it
            break
    laters = [later for _, later in rest]
    later_nodes = [later for later in laters if isinstance(later, Node)]
    items_written: Any = False
    if not any(later is False for later in laters):
        if later_nodes:
            try:
                items_written = lowering.schema(later_nodes)
            except Empty:
                items_written = False
        elif low > len(prefix_written):
            items_written = {}  # (the strict reading aside: the schema needs more items)
    if items_written is False:
        high = _least(high, len(prefix_written))
    if high is not None and low > high:
        raise Empty(flat.arrays[0].path, "it needs more items than it allows")
    written: dict[str, Any] = {"type": "array"}
    if prefix_written:
        written["prefixItems"] = prefix_written
    written["items"] = items_written
    if low:
        written["minItems"] = low
    if high is not None and items_written is not False:
        written["maxItems"] = high
    return written


# -- objects ------------------------------------------------------------------------------------


def write_object(lowering: Lowering, flat: Flat) -> dict:
    parts = flat.objects
    declared: dict[str, None] = {}
    required: dict[str, None] = {}
    low, high = 0, None
    for node in parts:
        schema = node.schema
        declared.update(dict.fromkeys(schema.get("properties") or {}))
        if isinstance(schema.get("required"), list):
            required.update(dict.fromkeys(schema["required"]))
        if lowering.doc.draft == "3":
            for name, sub in (schema.get("properties") or {}).items():
                if isinstance(sub, dict) and sub.get("required") is True:
                    required[name] = None
        low = max(low, count_of(schema, "minProperties", 0))
        high = _least(high, count_of(schema, "maxProperties", None))
    required.update(dict.fromkeys(sorted(flat.required)))
    if high is not None and low > high:
        raise Empty(parts[0].path, "its minProperties is above its maxProperties")
    path = parts[0].path if parts else (flat.sources[0].path if flat.sources else "")
    properties: dict[str, Any] = {}
    for name in {**declared, **required}:
        nodes = _property_nodes(lowering, parts, name)
        if nodes is None or name in flat.forbidden:
            if name in required:
                raise Empty(path, f"required property {name!r} is forbidden by the rest of it")
            continue
        try:
            child = lowering.schema(nodes) if nodes else {}
            held_off = [value for excluded, value in flat.excluded if excluded == name]
            if held_off:
                child = without_values(lowering, child, held_off, path)
            properties[name] = child
        except Empty:
            if name in required:
                raise
    written: dict[str, Any] = {"type": "object", "properties": properties}
    names = [name for name in required if name in properties]
    if names:
        written["required"] = names
    left_out = set(declared) | set(required) - set(properties)  # (none of their values fit)
    _write_others(lowering, flat, written, low, flat.forbidden | left_out)
    others = "additionalProperties" in written or "patternProperties" in written
    if high is not None:
        if len(names) > high:
            raise Empty(path, f"it requires {len(names)} properties and allows {high}")
        written["maxProperties"] = high
    if low:
        if low > len(properties) and not others:
            raise Empty(path, f"it needs {low} properties and can write {len(properties)}")
        written["minProperties"] = low
        _distinct_enough(written, low, others, path)
    return written


def _distinct_enough(written: dict, low: int, others: bool, path: str) -> None:
    """minProperties counts distinct names; the grammar counts the keys it writes, and may
    write an extra key twice ({"x": 1, "x": 2}: one property, parsed). Declared names are
    written once, and kept off the extra keys: so optional declared properties are made
    required until at most one extra key is needed (one cannot repeat)."""
    required = written.setdefault("required", [])
    optional = [name for name in written["properties"] if name not in required]
    while low - len(required) >= 2 and optional:
        required.append(optional.pop(0))
    if not required:
        del written["required"]
    if low - len(required) >= 2 and others:
        raise Unenforceable(
            f"{path}/minProperties",
            f"minProperties {low} beyond the declared properties is not enforced (extra keys "
            "are not kept apart: a grammar cannot compare them)",
        )


def _property_nodes(lowering: Lowering, parts: tuple[Node, ...], name: str) -> list[Node] | None:
    """The subschemas a property `name` meets (None when one of them forbids it)."""
    nodes = []
    for node in parts:
        schema = node.schema
        hit = False
        if name in (schema.get("properties") or {}):
            nodes.append(lowering.child(node, "properties", name))
            hit = True
        for pattern in schema.get("patternProperties") or {}:
            if re.search(pattern, name):
                nodes.append(lowering.child(node, "patternProperties", pattern))
                hit = True
        if not hit:
            later = _subschema(lowering, node, "additionalProperties")
            if later is None:
                later = _subschema(lowering, node, "unevaluatedProperties")
            if later is False:
                return None
            if later is not None:
                nodes.append(later)
        if "propertyNames" in schema:
            if not lowering.is_valid(name, lowering.child(node, "propertyNames"), unknown=False):
                return None
    return nodes


def _write_others(
    lowering: Lowering, flat: Flat, written: dict, low: int, kept_off: frozenset[str]
) -> None:
    """Properties beyond the declared ones: pattern keys, or additionalProperties, where every
    object subschema of the branch allows them; never a name `kept_off` (forbidden, or declared
    with no value that fits: as undeclared keys, they would be written)."""
    parts = flat.objects
    patterned = [node for node in parts if node.schema.get("patternProperties")]
    later = [_subschema(lowering, node, "additionalProperties") for node in parts]
    later = [
        value if value is not None else _subschema(lowering, node, "unevaluatedProperties")
        for node, value in zip(parts, later)
    ]
    names = [
        lowering.child(node, "propertyNames") for node in parts if "propertyNames" in node.schema
    ]
    written_names = list(written["properties"])
    if patterned:
        if len(parts) > 1 or kept_off:
            # (which subschema a pattern key falls under in the others, or a key both a pattern
            # and a forbidden name must allow: narrowed away)
            return
        node = patterned[0]
        patterns = node.schema["patternProperties"]
        every = [lowering.child(node, "patternProperties", p) for p in patterns]
        keys = {}
        for pattern in patterns:
            if not all(_names_allow(name.schema, pattern) for name in names):
                continue  # (a key both this pattern and propertyNames allow: not written)
            try:
                regex = json_string_regex(pattern)
            except PatternError as error:
                raise Unenforceable(
                    f"{node.path}/patternProperties", f"pattern {pattern!r} {error}"
                ) from None
            # a pattern key may be any name the regex matches, a declared one too (the engine
            # writes those through the pattern as well): its value meets what they all ask
            declared = [
                lowering.child(node, "properties", name)
                for name in node.schema.get("properties") or {}
                if re.fullmatch(regex, name)
            ]
            try:
                keys[regex] = lowering.schema(every + declared)
            except Empty:
                continue
        if keys:
            written["patternProperties"] = keys
        return
    if any(value is False for value in later) or (names and (kept_off or written_names)):
        # (keys from a propertyNames are not kept off the declared names, as keys of
        # additionalProperties alone are, and a forbidden name must stay out of them: extra
        # keys are written under a propertyNames of ours, or none)
        return
    explicit = [value for value in later if isinstance(value, Node)]
    if explicit:
        try:
            written["additionalProperties"] = lowering.schema(explicit)
        except Empty:
            return
    elif low > len(written["properties"]) and not names:
        written["additionalProperties"] = {}  # (strict reading aside: it needs more)
    if "additionalProperties" not in written:
        return
    if names:
        written["propertyNames"] = lowering.schema(names)
    elif kept_off:  # other keys, but neither a name kept off nor a declared one
        pattern = excluding_regex(set(kept_off) | set(written_names))
        written["propertyNames"] = {"type": "string", "pattern": pattern}


def _names_allow(names: object, pattern: str) -> bool:
    """Whether a propertyNames schema allows every key a pattern does (when it says the same
    pattern, or nothing of strings)."""
    if names is True or names in ({}, {"type": "string"}):
        return True
    return (
        isinstance(names, dict)
        and names.get("pattern") == pattern
        and set(names)
        <= {
            "pattern",
            "type",
        }
    )


def _subschema(lowering: Lowering, node: Node, key: str) -> Node | bool | None:
    """The schema under `key` as a Node (`true` too: it allows anything), False for `false`,
    None when absent."""
    value = node.schema.get(key)
    if value is None:
        return None
    if value is False:
        return False
    if isinstance(value, (dict, bool)):
        return lowering.child(node, key)
    return None


def _least(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)
