"""JSON schemas of structured outputs: checked against their draft's metaschema, then lowered
into the part of JSON Schema the grammar engine enforces exactly (lower.py), or refused naming
the keyword and its path.

    document.py     the schema's draft, its subschemas' paths, what a $ref points to
    conjunction.py  one branch: the keywords of several subschemas merged (Flat)
    lower.py        a schema -> branches -> the lowered schema (shared parts under $defs)
    conditions.py   dependencies, if / then / else and `not` as branches
    oneof.py        which branches of a oneOf match one option only (the rest are left out)
    values.py       a branch written per type; containers.py its arrays and objects
    patterns.py     a `pattern` (searched for, as Python's re) as a JSON-safe whole-match regex
    regex.py        those regexes: nodes, text, and the grammar (EBNF) the engine compiles
"""

from __future__ import annotations

import json
import logging
from typing import Any

from baton.engine.structured_output.schema.document import Unenforceable
from baton.engine.structured_output.schema.lower import lower_schema

# The lowered schema, as compact JSON (annotations dropped), is what the grammar grows with:
# a grammar costs compile time and memory in proportion to its size times the vocabulary
# (xgrammar compiles JSONSchemaBench's largest, ~240 KB of constraints, in ~2.5 s).
MAX_LOWERED_CHARS = 256 * 1024

logger = logging.getLogger("baton.engine")

__all__ = ["MAX_LOWERED_CHARS", "Unenforceable", "lowered_schema_text", "validator_class"]


def lowered_schema_text(schema: Any) -> str:
    """The schema the grammar engine compiles for `schema`, as JSON text (ValueError naming
    what is wrong or what cannot be enforced, and where)."""
    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs: a JSON schema must be an object or a boolean")
    draft = validator_class(schema)
    try:
        lowered = lower_schema(schema, draft)
    except Unenforceable as error:
        raise ValueError(f"structured_outputs: JSON schema {error}") from None
    except RecursionError:
        raise ValueError("structured_outputs: JSON schema nests too deeply") from None
    except Exception:  # noqa: BLE001 (a bug of the lowering: a 400 and a log line, not a 500)
        logger.exception("lowering a JSON schema failed")
        raise ValueError(
            "structured_outputs: JSON schema: the server could not read it (an internal error, "
            "logged)"
        ) from None
    text = json.dumps(lowered, ensure_ascii=False, separators=(",", ":"))
    if len(text) > MAX_LOWERED_CHARS:
        raise ValueError(
            f"structured_outputs: the JSON schema lowers to {len(text)} characters of "
            f"constraints (annotations left out), more than the {MAX_LOWERED_CHARS} this "
            "server compiles"
        )
    return text


def validator_class(schema: Any) -> type:
    """The draft `$schema` names; without one (or an unknown one), the newest of 2020-12, 7
    and 4 whose metaschema the schema meets (draft-4 style `items` lists and boolean
    `exclusiveMinimum` are common in schemas that name no draft)."""
    import jsonschema  # (imported here: ~0.1 s, only on the first schema)

    named = jsonschema.validators.validator_for(schema, default=None)
    candidates = [named] if named is not None else []
    candidates += [
        jsonschema.Draft202012Validator,
        jsonschema.Draft7Validator,
        jsonschema.Draft4Validator,
    ] * (named is None)
    first_error = None
    for candidate in candidates:
        try:
            candidate.check_schema(schema)
            return candidate
        except jsonschema.SchemaError as error:
            first_error = first_error or error
    assert first_error is not None
    where = "/" + "/".join(str(part) for part in first_error.path)
    raise ValueError(
        f"structured_outputs: invalid JSON schema at {where}: {first_error.message}"
    ) from None
