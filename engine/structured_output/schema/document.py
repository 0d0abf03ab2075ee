"""One JSON schema document: its draft, where its subschemas sit, and what a `$ref` points to.

Every subschema is addressed by its JSON pointer in the document ("/properties/a/items"), the
path error messages name. A `$ref` resolves inside the document only: a pointer ("#/x/y",
against the resource it sits in: a subschema with its own `$id` is one), an anchor
("#name": `$anchor`, or a draft-6/7 `$id` of "#name"), or a URI that names a resource of this
document by its `$id`. Anything else (another document, a URL) is refused.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

# Keywords whose value is a schema, a list of schemas, or a map of names to schemas (every
# draft's), as a validator descends into them; values under other keywords (const, enum,
# default, examples...) are data, never schemas.
SCHEMA_KEYWORDS = (
    "additionalProperties",
    "additionalItems",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
)
SCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems")
SCHEMA_MAP_KEYWORDS = (
    "properties",
    "patternProperties",
    "$defs",
    "definitions",
    "dependentSchemas",
)
# under these, a schema or a list of them; under dependencies, a schema or a list of names
MIXED_KEYWORDS = ("items", "extends", "dependencies", "type", "disallow")

LEGACY_DRAFTS = ("3", "4", "6", "7")  # `$ref` beside other keywords, `items` as a list...


class Unenforceable(ValueError):
    """A schema the grammar engine cannot be made to enforce: "at PATH: WHY"."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"at {path or '/'}: {why}")
        self.path = path
        self.why = why


class Empty(Exception):
    """No value meets a branch of a schema (the branch is dropped; a schema with no branch
    left is refused)."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(why)
        self.path = path
        self.why = why


@dataclass(frozen=True)
class Node:
    """A subschema with its place: `path` is its JSON pointer, `base` the path of the resource
    (the document, or a subschema with an `$id`) its `$ref`s resolve against."""

    path: str
    schema: Any
    base: str


def _escape(part: str) -> str:
    return part.replace("~", "~0").replace("/", "~1")


def _resource_id(schema: dict, draft: str) -> str | None:
    key = "id" if draft in ("3", "4") else "$id"
    value = schema.get(key)
    if not isinstance(value, str) or value.startswith("#"):
        return None
    return value


def subschemas(schema: Any) -> Iterator[tuple[tuple[str | int, ...], Any]]:
    """(keyword path, subschema) for every schema directly under `schema`."""
    if not isinstance(schema, dict):
        return
    for key in SCHEMA_KEYWORDS:
        if isinstance(schema.get(key), (dict, bool)):
            yield (key,), schema[key]
    for key in SCHEMA_LIST_KEYWORDS:
        for index, sub in enumerate(schema.get(key) or []):
            yield (key, index), sub
    for key in SCHEMA_MAP_KEYWORDS:
        value = schema.get(key)
        if isinstance(value, dict):
            for name, sub in value.items():
                yield (key, name), sub
    for key in MIXED_KEYWORDS:
        value = schema.get(key)
        if key == "dependencies" and isinstance(value, dict):
            for name, sub in value.items():
                if isinstance(sub, (dict, bool)):
                    yield (key, name), sub
        elif key != "dependencies" and isinstance(value, (dict, bool)) and key != "type":
            yield (key,), value
        elif isinstance(value, list):
            for index, sub in enumerate(value):
                if isinstance(sub, dict):
                    yield (key, index), sub


class Document:
    """The schema a request gives, read in its draft ("3", "4", "6", "7", "2019-09",
    "2020-12")."""

    def __init__(self, root: Any, draft: str) -> None:
        self.root = root
        self.draft = draft
        self._uris: dict[str, str] = {}  # absolute resource URI -> path
        self._anchors: dict[tuple[str, str], str] = {}  # (resource path, anchor) -> path
        self._base_uri: dict[str, str] = {}  # resource path -> its absolute URI
        self.refs: list[Node] = []  # the subschemas holding a $ref
        self._index(self.node(), "")

    def node(self, path: str = "") -> Node:
        if path == "":
            return Node("", self.root, "")
        return Node(path, self.at(path), self._resource_of(path))

    def child(self, node: Node, *parts: str | int) -> Node:
        """The subschema of `node` under `parts` (a keyword, then a name or an index)."""
        schema = node.schema
        for part in parts:
            schema = schema[part]
        path = node.path + "".join("/" + _escape(str(part)) for part in parts)
        if isinstance(schema, dict) and _resource_id(schema, self.draft) is not None:
            return Node(path, schema, path)
        return Node(path, schema, node.base)

    def at(self, path: str) -> Any:
        """The value at a JSON pointer path ("" is the root); KeyError when there is none."""
        value = self.root
        for part in path.split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(value, dict) and part in value:
                value = value[part]
            elif isinstance(value, list) and part.isdigit() and int(part) < len(value):
                value = value[int(part)]
            else:
                raise KeyError(path)
        return value

    def _resource_of(self, path: str) -> str:
        best = ""
        for resource in self._base_uri:
            if (path == resource or path.startswith(resource + "/")) and len(resource) > len(best):
                best = resource
        return best

    def _index(self, node: Node, uri: str) -> None:
        stack = [(node, uri)]
        while stack:
            node, uri = stack.pop()
            schema = node.schema
            if not isinstance(schema, dict):
                continue
            if node.base == node.path:  # a resource: the root, or a subschema with an $id
                own = _resource_id(schema, self.draft)
                uri = urldefrag(urljoin(uri, own))[0] if own else uri
                self._base_uri[node.path] = uri
                self._uris.setdefault(uri, node.path)
            anchor = schema.get("$anchor")
            old_anchor = schema.get("id" if self.draft in ("3", "4") else "$id")
            if isinstance(anchor, str):
                self._anchors[(node.base, anchor)] = node.path
            elif isinstance(old_anchor, str) and old_anchor.startswith("#") and len(old_anchor) > 1:
                self._anchors[(node.base, old_anchor[1:])] = node.path
            if isinstance(schema.get("$ref"), str):
                self.refs.append(node)
            for parts, _ in subschemas(schema):
                stack.append((self.child(node, *parts), uri))

    def check_refs(self) -> None:
        """Every `$ref` into this document points to something (one that does not makes the
        schema invalid wherever it sits; one to another document is refused where it is
        met)."""
        for node in self.refs:
            try:
                self.resolve(node)
            except Unenforceable as error:
                if "points to nothing" in error.why or "names no anchor" in error.why:
                    raise

    def resolve(self, node: Node) -> Node:
        """The subschema node's `$ref` points to (Unenforceable when it is not in here)."""
        ref = node.schema["$ref"]
        where = node.path + "/$ref"
        base_uri = self._base_uri.get(node.base, "")
        target_uri, fragment = urldefrag(urljoin(base_uri, ref) if base_uri else ref)
        if target_uri and target_uri not in self._uris:
            raise Unenforceable(
                where, f"$ref {ref!r} points outside this schema (only its own subschemas resolve)"
            )
        resource = self._uris.get(target_uri, node.base) if target_uri else node.base
        fragment = unquote(fragment)
        if fragment == "" or fragment.startswith("/"):
            path = resource + fragment if fragment else resource
            try:
                return Node(path, self.at(path), self._resource_of(path))
            except KeyError:
                raise Unenforceable(where, f"$ref {ref!r} points to nothing") from None
        path = self._anchors.get((resource, fragment))
        if path is None:
            raise Unenforceable(where, f"$ref {ref!r} names no anchor of this schema")
        return Node(path, self.at(path), self._resource_of(path))


@functools.cache
def _draft_names() -> dict[type, str]:
    import jsonschema

    return {
        jsonschema.Draft3Validator: "3",
        jsonschema.Draft4Validator: "4",
        jsonschema.Draft6Validator: "6",
        jsonschema.Draft7Validator: "7",
        jsonschema.Draft201909Validator: "2019-09",
        jsonschema.Draft202012Validator: "2020-12",
    }


def draft_of(validator_class: type) -> str:
    return _draft_names()[validator_class]
