"""A JSON schema rewritten into the part of JSON Schema the grammar engine enforces exactly.

xgrammar reads one "head" per schema object (the first of $ref, const, enum, anyOf, oneOf,
allOf) and drops every keyword beside it, reads one of format / pattern / lengths, ignores
multipleOf with a one-sided range, `uniqueItems`, `not`, `dependencies`... with a log line at
most. `lower_schema` turns a schema into one it reads whole, where each object is one of

    {}                                   any value
    {"$ref": "#/$defs/sN"}               a shared or recursive part, under the root's $defs
    {"const": v} / {"enum": [...]}       values (checked against every keyword beside them)
    {"anyOf": [...]}                     alternatives
    {"type": T, ...keywords of T}        one type, with only keywords the engine enforces

by expanding each schema into branches (anyOf / oneOf options, `$ref` targets and allOf members
merged with their siblings, dependencies as "absent, or present with what it needs") and
writing each branch per type. Where a keyword cannot be written exactly the branch is narrowed
(an unanchored pattern to what it must contain, `contains` to the first items, a
multipleOf's one-sided range to a window, a huge integer bound to +-2**53): a value the grammar
admits always meets the original schema. What no narrowing keeps sound is refused
(Unenforceable, naming the keyword's path): `not`, `uniqueItems`, overlapping `oneOf`, a `$ref`
outside the schema, a pattern with lookarounds.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any
from urllib.parse import quote

from baton.engine.structured_output.schema.conditions import condition, dependencies, negation
from baton.engine.structured_output.schema.conjunction import CONSTRAINTS, Flat, flat_of
from baton.engine.structured_output.schema.document import (
    Document,
    Empty,
    Node,
    Unenforceable,
    draft_of,
)
from baton.engine.structured_output.schema.oneof import exclusive
from baton.engine.structured_output.schema.values import ValueWriter

MAX_BRANCHES = 128  # alternatives one schema object may expand into
MAX_POSITIONS = 20000  # positions (properties, items...) one schema may lower into
MAX_COPIED_CHARS = 256  # a position met again is shared under $defs unless this small
MAX_WRITTEN = 20_000  # branches written in all: the lowering's work, bounded


def lower_schema(schema: Any, validator_class: type) -> Any:
    """`schema` (valid under its draft's metaschema) as the grammar engine reads it whole."""
    return Lowering(Document(schema, draft_of(validator_class)), validator_class).lower()


class Lowering:
    def __init__(self, doc: Document, validator_class: type) -> None:
        self.doc = doc
        self._validator_class = validator_class
        self._validator = validator_class(doc.root)
        self._targets: set[str] = set()  # $ref targets checked against the metaschema
        self.defs: dict[str, Any] = {}  # name -> lowered schema
        self._names: dict[tuple[str, ...], str] = {}  # the subschemas' paths -> name
        self._named = 0  # names given so far
        self._writing: dict[tuple[str, ...], str | None] = {}  # being written -> name if needed
        self._inline: dict[tuple[str, ...], Any] = {}  # written inline (once, so far)
        self._empty: dict[tuple[str, ...], Empty] = {}  # positions no value meets
        self.written = 0  # branches written, all positions together
        self._expanding: list[str] = []  # $ref targets being expanded inline (cycles)
        self.values = ValueWriter(self)

    def lower(self) -> Any:
        self.doc.check_refs()
        try:
            lowered = self.schema([self.doc.node()])
        except Empty as empty:
            raise Unenforceable(empty.path, f"no value meets this schema: {empty.why}") from None
        if self.defs:
            lowered = {**lowered, "$defs": self.defs}
        return lowered

    # -- one position (a property, the items...) holding the conjunction of subschemas --------

    def schema(self, nodes: list[Node]) -> Any:
        """The lowered schema of a value that meets all of `nodes`. Each position is written
        once: one a `$ref` leads to goes under $defs (every reference shares it), and so does
        one met again while it is being written (recursion ends at its name) or met a second
        time (a schema's branches share their properties: copies would double per level)."""
        referenced = any(isinstance(n.schema, dict) and "$ref" in n.schema for n in nodes)
        nodes = list({node.path: node for node in map(self._target, nodes)}.values())
        key = tuple(sorted(node.path for node in nodes))
        if key in self._names:
            return {"$ref": f"#/$defs/{self._names[key]}"}
        if key in self._empty:
            raise self._empty[key]
        if key in self._writing:  # recursion: refer to it by name, written when it is done
            self._names[key] = self._writing[key] = self._new_name()
            return {"$ref": f"#/$defs/{self._names[key]}"}
        if key in self._inline:  # written once already: shared from now on, there too
            lowered = self._inline[key]
            if len(json.dumps(lowered)) <= MAX_COPIED_CHARS:
                return lowered
            reference = self._shared(key, dict(lowered))
            lowered.clear()  # (the first copy, where it sits, becomes the reference)
            lowered.update(reference)
            return reference
        if len(self._names) + len(self._inline) >= MAX_POSITIONS:
            raise Unenforceable(nodes[0].path, f"lowers into more than {MAX_POSITIONS} parts")
        names_before, inline_before = set(self._names), set(self._inline)
        self._writing[key] = None
        try:
            lowered = self._branches(nodes)
        except Empty as empty:
            # what was written for it goes, with what refers to it (a position written before,
            # shared during it, stays: its first copy already refers to its name)
            for made in self._names.keys() - names_before - inline_before:
                self.defs.pop(self._names.pop(made), None)
            for made in self._inline.keys() - inline_before:
                del self._inline[made]
            self._empty[key] = empty
            raise
        finally:
            name = self._writing.pop(key)
        if name is not None:
            self.defs[name] = lowered
            return {"$ref": f"#/$defs/{name}"}
        if referenced:
            return self._shared(key, lowered)
        self._inline[key] = lowered
        return lowered

    def _new_name(self) -> str:
        """A name under $defs never given before (names of a position that turned out empty
        are taken back, so a count of the names held would repeat one)."""
        self._named += 1
        return f"s{self._named - 1}"

    def _shared(self, key: tuple[str, ...], lowered: Any) -> dict:
        name = self._names[key] = self._new_name()
        self.defs[name] = lowered
        return {"$ref": f"#/$defs/{name}"}

    def _target(self, node: Node) -> Node:
        """A subschema that only refers elsewhere stands for its target (one name for every
        reference to it)."""
        for _ in range(64):
            schema = node.schema
            if not (isinstance(schema, dict) and "$ref" in schema):
                return node
            if any(key in CONSTRAINTS for key in schema if key != "$ref"):
                return node
            node = self.resolve(node)
        raise Unenforceable(node.path, "$ref chain longer than 64")

    def _branches(self, nodes: list[Node]) -> Any:
        lowered, dropped = [], []
        flats = self.expand(nodes)
        self.written += len(flats)
        if self.written > MAX_WRITTEN:
            raise Unenforceable(nodes[0].path, f"lowers into more than {MAX_WRITTEN} branches")
        for flat in flats:
            try:
                lowered.append(self.values.write(flat))
            except Empty as empty:
                dropped.append(empty)
        if not lowered:
            raise (
                dropped[0]
                if dropped
                else Empty(nodes[0].path, "its alternatives exclude each other")
            )
        unique = list({json.dumps(item, sort_keys=True): item for item in lowered}.values())
        return unique[0] if len(unique) == 1 else {"anyOf": unique}

    # -- expansion into branches ------------------------------------------------------------

    def expand(self, nodes: list[Node]) -> list[Flat]:
        flats = [Flat()]
        for node in nodes:
            flats = self._product(flats, self.expand_one(node), node.path)
        return flats

    def _product(self, left: list[Flat], right: list[Flat], path: str) -> list[Flat]:
        merged = [
            m for a in left for b in right if (m := a.merge(b)) is not None and not m.hopeless()
        ]
        if len(merged) > MAX_BRANCHES:
            raise Unenforceable(path, f"combines into more than {MAX_BRANCHES} alternatives")
        return merged

    def child(self, node: Node, *parts: str | int) -> Node:
        return self.doc.child(node, *parts)

    def expand_one(self, node: Node) -> list[Flat]:
        """The branches of one subschema: its own keywords merged with its $ref, allOf, anyOf,
        oneOf, dependencies and if/then/else."""
        schema = node.schema
        if schema is True:
            return [Flat(sources=(node,))]
        if schema is False:
            return []
        draft = self.doc.draft
        for keyword in ("disallow", "$recursiveRef", "$dynamicRef", "maxContains"):
            if keyword in schema:
                raise Unenforceable(f"{node.path}/{keyword}", _REFUSED[keyword])
        own = flat_of(self.doc, node)
        flats = [own] if own is not None else []
        if "$ref" in schema:
            flats = self._product(flats, self._ref(node), node.path)
        for key in ("allOf", "extends"):
            members = schema.get(key)
            if isinstance(members, dict):  # draft 3's extends: one schema
                flats = self._product(flats, self.expand_one(self.child(node, key)), node.path)
            for index in range(len(members) if isinstance(members, list) else 0):
                member = self.expand_one(self.child(node, key, index))
                flats = self._product(flats, member, node.path)
        if draft == "3" and isinstance(schema.get("type"), list):
            if any(isinstance(entry, dict) for entry in schema["type"]):
                flats = self._product(flats, self._draft3_union(node), node.path)
        if "anyOf" in schema:
            options = [
                self.expand_one(self.child(node, "anyOf", i)) for i in range(len(schema["anyOf"]))
            ]
            flats = self._product(flats, [f for option in options for f in option], node.path)
        if "oneOf" in schema:
            options = [
                self._product(flats, self.expand_one(self.child(node, "oneOf", i)), node.path)
                for i in range(len(schema["oneOf"]))
            ]
            flats = exclusive(self, node, options)
        for branches in dependencies(self, node):
            flats = self._product(flats, branches, node.path)
        if "not" in schema:
            negated = negation(self, self.child(node, "not"), depth=8)
            if negated is None:  # (values alone can still be checked)
                unchecked = (f"{node.path}/not",)
                flats = [replace(flat, unchecked=flat.unchecked + unchecked) for flat in flats]
            else:
                flats = self._product(flats, negated, node.path)
        if "if" in schema and ("then" in schema or "else" in schema):
            flats = self._product(flats, condition(self, node), node.path)
        return flats

    def _ref(self, node: Node) -> list[Flat]:
        target = self.resolve(node)
        if target.path in self._expanding:
            raise Unenforceable(
                f"{node.path}/$ref", "refers back to itself with no property or item in between"
            )
        self._expanding.append(target.path)
        try:
            return self.expand_one(target)
        finally:
            self._expanding.pop()

    def _draft3_union(self, node: Node) -> list[Flat]:
        branches = []
        for index, entry in enumerate(node.schema["type"]):
            if isinstance(entry, dict):
                branches += self.expand_one(self.child(node, "type", index))
            else:
                branches += self.expand_one(
                    Node(f"{node.path}/type/{index}", {"type": entry}, node.base)
                )
        return branches

    def resolve(self, node: Node) -> Node:
        """The target of node's `$ref`, checked against the metaschema when it lies where the
        document's own check did not look (a `$ref` may point anywhere: "#/x/y")."""
        target = self.doc.resolve(node)
        if target.path not in self._targets and target.path != "":  # (the root: checked)
            self._targets.add(target.path)
            try:
                self._validator_class.check_schema(target.schema)
            except Exception as error:  # noqa: BLE001 (jsonschema.SchemaError, lazily imported)
                where = target.path + "".join(f"/{part}" for part in getattr(error, "path", ()))
                message = getattr(error, "message", str(error))
                raise Unenforceable(where, f"invalid schema: {message}") from None
        return target

    # -- what values are valid (const / enum candidates, propertyNames) ------------------------

    def is_valid(self, value: Any, node: Node, unknown: bool, beside_values: bool = False) -> bool:
        """`value` against the subschema at `node`, with the document's $refs and draft;
        `unknown` where the validator fails on the schema (each caller's safe side).
        `beside_values`: against its keywords other than const / enum (a value a branch's
        merged values hold already meets those: a large enum is then not read once per value)."""
        schema = node.schema
        if beside_values and node.base == "" and isinstance(schema, dict):
            schema = {k: v for k, v in schema.items() if k not in ("const", "enum")}
            if not CONSTRAINTS & schema.keys():
                return True
        if node.base == "":
            validator = self._validator.evolve(schema=schema)
        else:  # (its $refs resolve against its own resource, which a pointer enters)
            pointer = "#" + quote(node.path, safe="/~!$&'()*+,;=:@")
            validator = self._validator.evolve(schema={"$ref": pointer})
        try:
            return validator.is_valid(value)
        except Exception:  # noqa: BLE001 (e.g. referencing's errors on odd documents)
            return unknown


_REFUSED = {
    "disallow": "'disallow' is not enforced (the grammar engine can only write what a schema "
    "allows)",
    "$recursiveRef": "'$recursiveRef' is not resolved (use $ref)",
    "$dynamicRef": "'$dynamicRef' is not resolved (use $ref)",
    "maxContains": "'maxContains' is not enforced",
}
