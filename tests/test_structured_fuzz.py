"""Random JSON schemas (seeded) through the structured-output check and the grammar: keywords
combined as no one writes them by hand (a `not` of an `if`, a oneOf beside a $ref beside a
type...), where the lowering's narrowings meet each other. Each schema the metaschema accepts
is refused with a ValueError or lowered; a lowered one compiles; what the grammar writes
(random walks, tests/structured_walk.py) meets the schema as given, and random values the
schema refuses are not written.

This found: a `not` of `required` written for values that are no objects, a oneOf branch kept
on types a `type` beside it then changed, pattern keys that ignored propertyNames, extra keys
under a propertyNames that wrote a declared name, a declared property no value fits written as
an extra key, a one character maxLength that wrote raw control characters, a pattern xgrammar
left out."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr

from baton.engine.core.sampling_params import StructuredOutputs
from baton.engine.structured_output import check_structured_outputs
from baton.engine.structured_output.spec import compile_structured
from tests.structured_walk import Walker

NAMES = ["a", "b", "kind"]
VALUES = [0, 1, 2.5, -3, "a", "b", "x", True, None, [1], {"a": 1}]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", ["string", "null"]]
PATTERNS = ["^a", "b$", "^[a-c]+$", "^x?y*$", "\\d", "^(ab|c)+$"]


def random_schema(rng: random.Random, depth: int):
    if depth == 0 or rng.random() < 0.15:
        return rng.choice(
            [True, {}, {"type": rng.choice(TYPES[2:])}, {"const": rng.choice(VALUES)}]
        )

    def sub():
        return random_schema(rng, depth - 1)

    maybe = {
        "type": lambda: rng.choice(TYPES),
        "properties": lambda: {n: sub() for n in rng.sample(NAMES, rng.randint(1, 3))},
        "required": lambda: rng.sample(NAMES, rng.randint(1, 2)),
        "additionalProperties": lambda: rng.choice([False, True, sub()]),
        "patternProperties": lambda: {rng.choice(PATTERNS[:3]): sub()},
        "propertyNames": lambda: rng.choice([{"maxLength": 2}, {"pattern": "^[a-c]+$"}]),
        "minProperties": lambda: rng.randint(0, 2),
        "maxProperties": lambda: rng.randint(0, 3),
        "items": sub,
        "prefixItems": lambda: [sub() for _ in range(rng.randint(1, 2))],
        "minItems": lambda: rng.randint(0, 3),
        "maxItems": lambda: rng.randint(0, 3),
        "contains": sub,
        "minimum": lambda: rng.choice([-5, 0, 1.5, 3]),
        "maximum": lambda: rng.choice([0, 2, 7.5, 100]),
        "exclusiveMinimum": lambda: rng.choice([0, 1]),
        "multipleOf": lambda: rng.choice([2, 3, 0.5, 2000]),
        "minLength": lambda: rng.randint(0, 4),
        "maxLength": lambda: rng.randint(1, 6),
        "pattern": lambda: rng.choice(PATTERNS),
        "format": lambda: rng.choice(["date", "email", "color"]),
        "enum": lambda: rng.sample(VALUES, rng.randint(1, 4)),
        "anyOf": lambda: [sub() for _ in range(rng.randint(1, 3))],
        "oneOf": lambda: [sub() for _ in range(rng.randint(1, 3))],
        "allOf": lambda: [sub() for _ in range(rng.randint(1, 2))],
        "not": sub,
        "if": sub,
        "then": sub,
        "else": sub,
        "dependentRequired": lambda: {rng.choice(NAMES): rng.sample(NAMES, 1)},
        "dependentSchemas": lambda: {rng.choice(NAMES): sub()},
        "$ref": lambda: rng.choice(["#", "#/$defs/d", "#/properties/a"]),
    }
    schema = {key: make() for key, make in maybe.items() if rng.random() < 0.12}
    schema["$defs"] = {"d": sub()}
    return schema


def random_value(rng: random.Random, depth: int = 2):
    if depth == 0 or rng.random() < 0.5:
        return rng.choice([*VALUES, "ab", "xyy", "2020-01-01", "a@b.co", 4, 2000, -1, 7.5, ""])
    if rng.random() < 0.5:
        return [random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    keys = [*NAMES, "ab", "x"]
    return {rng.choice(keys): random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))}


def _valid(validator, value) -> bool:
    try:
        return validator.is_valid(value)
    except RecursionError:  # ($ref "#" under an `if`: jsonschema recurses for some values)
        return True


def writes(compiled, value) -> bool:
    """Whether the grammar writes `value` (in its compact form, `, ` and `: `)."""
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    text = json.dumps(value, separators=(", ", ": "), ensure_ascii=False)
    return matcher.accept_string(text) and matcher.is_completed()


def test_random_schemas_are_refused_cleanly_or_written_only_as_they_allow():
    walker = Walker()
    rng = random.Random(51)
    accepted = broken = 0
    for _ in range(250):
        schema = random_schema(rng, 3)
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError:
            continue
        structured = StructuredOutputs(kind="json", spec=json.dumps(schema), after_token_ids=())
        try:
            checked = check_structured_outputs(structured)
        except ValueError as error:
            assert "could not" not in str(error), (schema, error)  # (a gap or a lowering bug)
            continue
        accepted += 1
        compiled = compile_structured(walker.compiler, checked)
        validator = jsonschema.Draft202012Validator(schema)
        for seed in range(2):
            text = walker.walk(compiled, seed, max_tokens=2000)
            if text is not None and not validator.is_valid(json.loads(text)):
                broken += 1
                pytest.fail(f"{json.dumps(schema)} wrote {text}")
        for _ in range(20):
            value = random_value(rng)
            if not _valid(validator, value) and writes(compiled, value):
                broken += 1
                pytest.fail(f"{json.dumps(schema)} writes {json.dumps(value)}")
    assert accepted >= 100 and not broken
