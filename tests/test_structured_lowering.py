"""JSON schemas lowered into what the grammar engine enforces (engine/structured_output/schema/).

xgrammar reads one keyword of several and drops the rest with a log line; the lowering rewrites
each schema so that what the grammar admits always meets the schema as given, narrowing where a
keyword cannot be written exactly, refusing (naming the keyword and its path) where no narrowing
is sound. Each case: the schema, a text the grammar writes, texts it must not."""

from __future__ import annotations

import json
import re

import pytest
import xgrammar as xgr

from baton.engine.core.sampling_params import StructuredOutputs
from baton.engine.structured_output import check_structured_outputs
from baton.engine.structured_output.spec import compile_structured
from tests.structured_walk import Walker
from tests.test_structured_spec import spec

DRAFT3 = "http://json-schema.org/draft-03/schema#"
DRAFT4 = "http://json-schema.org/draft-04/schema#"


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return Walker().compiler


def admits(compiler, schema, text: str) -> bool:
    """Whether the grammar compiled for the lowered schema writes exactly `text`."""
    compiled = compile_structured(compiler, check_structured_outputs(spec("json", schema)))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


# (schema, a text the grammar writes, texts it must not): found unsound or refused before
LOWERED = {
    # the issue's unsound acceptances
    "multipleOf with a one-sided range": (
        {"type": "integer", "minimum": 0, "multipleOf": 12},
        "24",
        ["5", "-12"],
    ),
    "draft-03 required: true": (
        {
            "$schema": DRAFT3,
            "type": "object",
            "properties": {"a": {"type": "integer", "required": True}},
        },
        '{"a": 1}',
        ["{}"],
    ),
    "draft-03 dependencies and type lists": (
        {
            "$schema": DRAFT3,
            "type": ["object", "null"],
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependencies": {"a": "b"},
        },
        '{"a": 1, "b": 2}',
        ['{"a": 1}', '"x"'],
    ),
    # keywords beside a head (anyOf, oneOf, $ref, enum), merged into each branch
    "type beside anyOf": (
        {
            "type": "object",
            "anyOf": [{"properties": {"a": {"type": "integer"}}, "required": ["a"]}],
        },
        '{"a": 1}',
        ["1", "{}"],
    ),
    "properties beside oneOf": (
        {
            "properties": {"k": {"enum": ["x", "y"]}, "n": {"type": "integer"}},
            "required": ["k"],
            "oneOf": [
                {"properties": {"k": {"const": "x"}}},
                {"properties": {"k": {"const": "y"}, "n": {"maximum": 3}}},
            ],
        },
        '{"k": "y", "n": 3}',
        ['{"k": "y", "n": 4}', '{"k": "z"}'],
    ),
    "$ref with siblings": (
        {"$defs": {"n": {"type": "integer"}}, "$ref": "#/$defs/n", "maximum": 3},
        "3",
        ["4"],
    ),
    "enum with a type": ({"type": "string", "enum": ["a", 1, None]}, '"a"', ["1", "null"]),
    "allOf merged": (
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}},
                {"required": ["a"]},
            ]
        },
        '{"a": 1}',
        ["{}"],
    ),
    "$ref into any location": (
        {"$ref": "#/x/y", "x": {"y": {"type": "integer", "maximum": 2}}},
        "2",
        ["3"],
    ),
    # keywords without `type`: the type they imply
    "format without type": ({"format": "date"}, '"2024-02-29"', ['"x"', "1"]),
    "pattern without type": ({"pattern": "^a+$"}, '"aa"', ['"b"']),
    "minimum without type": ({"minimum": 3}, "4", ["2"]),
    # two string constraints, a pattern's search semantics, JSON's escapes
    "pattern with lengths": (
        {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
        '"abc"',
        ['"abcd"', '"ab1"'],
    ),
    "pattern searched for": (
        {"type": "string", "pattern": "^https://"},
        '"https://a.b"',
        ['"http://a"'],
    ),
    "format beside pattern (an annotation)": (
        {"type": "string", "format": "email", "pattern": "^a"},
        '"ab"',
        ['"b@c.de"'],
    ),
    "a format its lengths cut: the lengths": (
        {"type": "string", "format": "email", "maxLength": 0},
        '""',
        ['"a@b.co"'],
    ),
    "a format within its lengths: the format": (
        {"type": "string", "format": "date", "maxLength": 10},
        '"2024-02-29"',
        ['"x"'],
    ),
    "unknown format (an annotation)": ({"type": "string", "format": "color"}, '"red"', ["1"]),
    "lengths never write a raw control character": (
        {"type": "string", "maxLength": 3},
        '"a\\tb"',
        ['"a\tb"', '"a\x01"', '"abcd"'],
    ),
    "one character at most: no raw control character either": (
        {"type": "string", "maxLength": 1},
        '"\\b"',
        ['"\x08"', '"ab"'],
    ),
    # objects
    "required name outside properties": (
        {"type": "object", "required": ["a"]},
        '{"a": [1]}',
        ["{}"],
    ),
    "declared name matching a pattern meets both": (
        {
            "type": "object",
            "properties": {"xa": {"type": "integer", "maximum": 5}},
            "patternProperties": {"^x": {"type": "integer", "minimum": 1}},
            "additionalProperties": False,
        },
        '{"xa": 5}',
        ['{"xa": 0}', '{"xa": 6}'],
    ),
    "dependencies as branches": (
        {
            "type": "object",
            "properties": {"card": {"type": "string"}, "billing": {"type": "string"}},
            "dependencies": {"card": ["billing"]},
        },
        '{"card": "1", "billing": "x"}',
        ['{"card": "1"}'],
    ),
    "dependentSchemas as branches": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependentSchemas": {"a": {"properties": {"b": {"maximum": 0}}, "required": ["b"]}},
        },
        '{"a": 1, "b": 0}',
        ['{"a": 1}', '{"a": 1, "b": 1}'],
    ),
    "if / then / else": (
        {
            "type": "object",
            "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer"}},
            "required": ["kind"],
            "if": {"required": ["n"]},
            "then": {"properties": {"kind": {"const": "a"}}},
            "else": {"properties": {"kind": {"const": "b"}}},
        },
        '{"kind": "a", "n": 1}',
        ['{"kind": "b", "n": 1}', '{"kind": "a"}'],
    ),
    "if a property has a value, then ... else ...": (
        {
            "type": "object",
            "properties": {"kind": {"enum": ["car", "bike"]}, "wheels": {"type": "integer"}},
            "required": ["kind", "wheels"],
            "if": {"properties": {"kind": {"const": "car"}}},
            "then": {"properties": {"wheels": {"const": 4}}},
            "else": {"properties": {"wheels": {"maximum": 2}}},
        },
        '{"kind": "bike", "wheels": 2}',
        ['{"kind": "car", "wheels": 2}', '{"kind": "bike", "wheels": 4}'],
    ),
    "not of a type": (
        {"not": {"type": ["string", "object", "array", "null"]}},
        "true",
        ['"a"', "null"],
    ),
    "not of required": (
        {"type": "object", "properties": {"a": {}, "b": {}}, "not": {"required": ["a", "b"]}},
        '{"a": 1}',
        ['{"a": 1, "b": 2}'],
    ),
    "exactly one of two properties (oneOf of required)": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
        },
        '{"b": 2}',
        ['{"a": 1, "b": 2}', "{}"],
    ),
    # arrays
    "draft-04 items list": (
        {
            "$schema": DRAFT4,
            "type": "array",
            "items": [{"type": "integer"}],
            "additionalItems": False,
        },
        "[1]",
        ['["a"]', "[1, 2]"],
    ),
    "contains: the first item meets it": (
        {"type": "array", "items": {"type": "integer"}, "contains": {"minimum": 5}},
        "[7, 1]",
        ["[]", "[1]"],
    ),
    "counts written as floats (2.0)": (
        {"type": "array", "items": {"type": "string", "maxLength": 2.0}, "minItems": 1.0},
        '["ab"]',
        ["[]", '["abc"]'],
    ),
    "minItems with no items schema": ({"type": "array", "minItems": 2}, '[1, "a"]', ["[1]"]),
    # numbers
    "draft-04 exclusiveMinimum": (
        {"$schema": DRAFT4, "type": "number", "minimum": 0, "exclusiveMinimum": True},
        "0.5",
        ["0"],
    ),
    "fractional multipleOf: whole multiples": (
        {"type": "number", "multipleOf": 0.5, "maximum": 9},
        "4",
        ["4.5", "10"],
    ),
    "multipleOf over 1024: listed": (
        {"type": "integer", "multipleOf": 3600, "minimum": 0},
        "7200",
        ["3601"],
    ),
    "huge integer bounds": (
        {"type": "integer", "maximum": 2**63},
        "9007199254740992",
        ["9007199254740993"],
    ),
}


@pytest.mark.parametrize(("schema", "good", "bad"), LOWERED.values(), ids=LOWERED.keys())
def test_lowered_schemas_write_only_what_the_schema_allows(compiler, schema, good, bad):
    assert admits(compiler, schema, good)
    for text in bad:
        assert not admits(compiler, schema, text), text


# (schema, what the refusal names): the issue's unsound acceptances, now refused
HIDDEN_BEHIND_REF = [
    ({"$ref": "#/x/y", "x": {"y": {"type": "array", "uniqueItems": True}}}, "at /x/y/uniqueItems"),
    ({"$ref": "#/x/y", "x": {"y": {"type": "string", "not": {"pattern": "a"}}}}, "at /x/y/not"),
    ({"$ref": "#/x", "x": {"oneOf": [{"type": "integer"}, {"minimum": 0}]}}, "at /x/oneOf"),
]


@pytest.mark.parametrize(("schema", "named"), HIDDEN_BEHIND_REF, ids=lambda v: str(v)[:30])
def test_a_keyword_reached_through_any_ref_is_checked(schema, named):
    with pytest.raises(ValueError, match="JSON schema") as error:
        check_structured_outputs(spec("json", schema))
    assert named in str(error.value)


def test_a_oneof_branch_that_may_match_another_option_is_left_out(compiler):
    """A branch is kept when it fails every other option: with none left, the oneOf is refused
    (a string, or one of these strings?); with some left, only those are written."""
    with pytest.raises(ValueError, match="at /oneOf: its options may match"):
        check_structured_outputs(spec("json", {"oneOf": [{"type": "string"}, {"enum": ["a"]}]}))
    mixed = {"oneOf": [{"type": "integer"}, {"type": "array"}, {"enum": [1, "a"]}]}
    assert admits(compiler, mixed, "[]")  # arrays match the second option only
    assert admits(compiler, mixed, '"a"')  # a value of the third option alone
    for text in ("1", "2"):  # 1 matches two options; 2 might have been 1
        assert not admits(compiler, mixed, text), text


def test_the_lowered_schema_drops_annotations_and_shares_referenced_parts():
    schema = {
        "title": "T",
        "description": "d" * 10_000,
        "$defs": {"p": {"type": "object", "properties": {"next": {"$ref": "#/$defs/p"}}}},
        "properties": {"head": {"$ref": "#/$defs/p"}, "tail": {"$ref": "#/$defs/p"}},
    }
    lowered = json.loads(check_structured_outputs(spec("json", schema)).spec)
    assert "d" * 100 not in json.dumps(lowered)
    (shared,) = lowered["$defs"].values()  # one definition for both references and the recursion
    assert lowered["properties"]["head"] == lowered["properties"]["tail"]
    assert shared["properties"]["next"] == lowered["properties"]["head"]


def test_a_tool_call_grammar_resolves_each_tools_refs_in_its_own_schema():
    from baton.server.openai.tool_choice import required_schema
    from tests.test_tool_choice import chat

    tree = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "c": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v"],
    }
    other = {
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/n"}},
        "$defs": {"n": {"type": "string"}},
    }
    tools = [
        {"type": "function", "function": {"name": "t", "parameters": tree}},
        {
            "type": "function",
            "function": {"name": "u", "parameters": {**other, "$defs": {"n": {"type": "boolean"}}}},
        },
    ]
    schema = required_schema(chat(tools=tools).tools, None)
    import jsonschema

    jsonschema.validate([{"name": "t", "parameters": {"v": 1, "c": [{"v": 2, "c": []}]}}], schema)
    with pytest.raises(jsonschema.ValidationError):  # "#" was the wrapper array once
        jsonschema.validate([{"name": "t", "parameters": {"v": 1, "c": [[{"name": "t"}]]}}], schema)
    jsonschema.validate([{"name": "u", "parameters": {"x": True}}], schema)  # its own $defs
    check_structured_outputs(
        StructuredOutputs(kind="json", spec=json.dumps(schema), after_token_ids=())
    )


def test_property_names_json_escapes_are_written_escaped(compiler):
    schema = {
        "type": "object",
        "properties": {'a"b\\c\n': {"type": "integer"}},
        "required": ['a"b\\c\n'],
    }
    assert admits(compiler, schema, json.dumps({'a"b\\c\n': 1}))
    assert not admits(compiler, schema, '{"a"b\\c\n": 1}')


def test_branches_sharing_a_property_write_it_once_so_nesting_stays_linear():
    """Each level's two branches hold the same child: written twice per level, 30 levels were
    2**30 copies (a request that never finished); shared, the lowered schema grows by level."""
    node: dict = {"type": "integer"}
    for _ in range(30):
        node = {
            "type": "object",
            "properties": {"x": node},
            "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        }
    lowered = check_structured_outputs(spec("json", node)).spec
    assert len(lowered) < 50_000


def test_a_branch_dropped_as_empty_leaves_no_reference_to_what_it_wrote(compiler):
    """Positions written (and shared) while a branch that turns out empty was being written
    leave with it; one written before it and shared during it stays."""
    shared = {"type": "object", "properties": {"deep": {"type": "string", "maxLength": 300}}}
    schema = {
        "type": "object",
        "properties": {"first": {"$ref": "#/$defs/a"}, "p": {"$ref": "#/$defs/a"}},
        "$defs": {
            "a": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {
                            "k": shared,
                            "bad": {"type": "string", "minLength": 3, "maxLength": 1},
                        },
                        "required": ["bad"],
                    },
                    {"type": "object", "properties": {"k": shared}},
                ]
            }
        },
    }
    lowered = check_structured_outputs(spec("json", schema)).spec
    names = set(re.findall(r'"#/\$defs/(s\d+)"', lowered))
    assert names <= set(json.loads(lowered).get("$defs", {})), lowered
    assert admits(compiler, schema, '{"first": {"k": {"deep": "x"}}}')


def test_extra_keys_never_write_a_declared_name_with_another_value(compiler):
    """Keys of additionalProperties keep off the declared names in xgrammar, keys under a
    propertyNames do not ({"c": 5} was written for a `c` that must be null)."""
    named = {
        "type": "object",
        "properties": {"c": {"type": "null"}},
        "additionalProperties": True,
        "propertyNames": {"pattern": "^[a-c]+$"},
    }
    assert admits(compiler, named, '{"c": null}')
    assert not admits(compiler, named, '{"c": 5}')
    one_of_two = {  # the oneOf leaves `b` out of its first branch through a propertyNames
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "additionalProperties": {"type": "string"},
        "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
    }
    assert admits(compiler, one_of_two, '{"a": 1, "x": "y"}')
    for text in ('{"a": 1, "a": "y"}', '{"a": 1, "b": "y"}', '{"a": 1, "b": 2}'):
        assert not admits(compiler, one_of_two, text), text


def test_a_declared_property_no_value_fits_is_not_written_as_an_extra_key(compiler):
    schema = {
        "type": "object",
        "properties": {"a": {"type": "null", "enum": [1]}, "b": {"type": "integer"}},
        "additionalProperties": True,
    }
    assert admits(compiler, schema, '{"b": 1, "c": 2}')
    for text in ('{"a": 1}', '{"a": null}', '{"b": 1, "a": 2}'):
        assert not admits(compiler, schema, text), text


def test_a_oneof_over_values_keeps_the_values_one_option_allows(compiler):
    schema = {
        "type": "object",
        "properties": {"a": {}, "b": {}},
        "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
        "enum": [{"a": 1}, {"a": 1, "b": 2}, {"b": 2}],
    }
    # (a const is written compact)
    assert admits(compiler, schema, '{"a":1}') and admits(compiler, schema, '{"b":2}')
    assert not admits(compiler, schema, '{"a":1,"b":2}')  # both options: not one


def test_min_properties_counts_distinct_keys_which_extra_keys_may_not_be(compiler):
    """A grammar may write an extra key twice ({"x": 1, "x": 2}: one property once parsed):
    minProperties is met with declared properties made required, at most one extra key."""
    declared = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "additionalProperties": {"type": "integer"},
        "minProperties": 2,
    }
    assert admits(compiler, declared, '{"a": 1, "x": 2}')
    assert not admits(compiler, declared, '{"x": 1, "x": 2}')
    extras_only = {
        "type": "object",
        "additionalProperties": {"type": "integer"},
        "minProperties": 2,
    }
    with pytest.raises(ValueError, match="at /minProperties: minProperties 2 beyond"):
        check_structured_outputs(spec("json", extras_only))
