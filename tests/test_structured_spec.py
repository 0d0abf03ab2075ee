"""What a structured-output spec may hold (engine/structured_output/spec.py, schema/).

Every JSON Schema keyword the check lets through is enforced by the grammar the engine compiles
for the lowered spec (an instance that breaks it cannot be written); what it refuses, no grammar
of the engine's would enforce. tests/test_structured_lowering.py holds the lowering's own cases,
tests/test_structured_corpus.py real-world schemas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xgrammar as xgr
from pydantic import BaseModel, Field

from baton.engine.core.sampling_params import StructuredOutputs
from baton.engine.structured_output import check_structured_outputs
from baton.engine.structured_output.spec import MAX_SPEC_CHARS, compile_structured

ASSETS = Path(__file__).parents[1] / "assets"


def spec(kind: str, value) -> StructuredOutputs:
    text = value if isinstance(value, str) else json.dumps(value)
    return StructuredOutputs(kind=kind, spec=text, after_token_ids=())


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ASSETS))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    return xgr.GrammarCompiler(info, max_threads=1)


def writes(compiler, structured: StructuredOutputs, text: str) -> bool:
    """Whether the grammar the engine compiles for the checked spec lets the model write exactly
    `text` (and then stop)."""
    compiled = compile_structured(compiler, check_structured_outputs(structured))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_completed()


# (schema, an instance it allows, one it forbids): each accepted keyword, enforced
ENFORCED = [
    ({"type": "integer", "minimum": 3, "maximum": 7}, "5", "8"),
    ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    ({"type": "integer", "multipleOf": 3}, "6", "4"),
    ({"type": "number", "exclusiveMaximum": 1.5}, "1.25", "1.5"),
    ({"type": "string", "minLength": 2, "maxLength": 3}, '"abc"', '"abcd"'),
    ({"type": "string", "pattern": "^a[0-9]$"}, '"a1"', '"b1"'),
    ({"type": "string", "format": "date"}, '"2024-02-29"', '"tomorrow"'),
    ({"type": "string", "format": "uuid"}, '"123e4567-e89b-12d3-a456-426614174000"', '"x"'),
    ({"enum": ["red", 3, None]}, "3", '"blue"'),
    ({"const": {"a": [1, 2]}}, '{"a":[1,2]}', '{"a":[1]}'),  # (written compact)
    ({"type": "boolean"}, "true", "1"),
    ({"type": ["string", "null"]}, "null", "0"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2}, "[1, 2]", "[]"),
    ({"type": "array", "prefixItems": [{"type": "string"}], "items": False}, '["a"]', '["a", "b"]'),
    (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        '{"a": 1}',
        "{}",
    ),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, "{}", '{"b": 1}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"k": 1}', '{"k": "v"}'),
    (
        {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 1},
        '{"k": 1}',
        '{"k": 1, "j": 2}',
    ),
    (
        {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}},
        '{"x1": 1}',
        '{"y1": 1}',
    ),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}, '"a"', '"ab"'),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "1", "null"),
    ({"allOf": [{"type": "integer", "maximum": 2}]}, "2", "3"),
    (
        {"$defs": {"n": {"type": "integer", "maximum": 9}}, "$ref": "#/$defs/n"},
        "9",
        "10",
    ),
    (
        {  # recursive: a tree of lists
            "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}, "maxItems": 2}},
            "$ref": "#/$defs/t",
        },
        "[[], [[]]]",
        "[[], [], []]",
    ),
]


@pytest.mark.parametrize(("schema", "good", "bad"), ENFORCED, ids=lambda v: json.dumps(v)[:40])
def test_each_accepted_keyword_is_enforced(compiler, schema, good, bad):
    structured = spec("json", schema)
    check_structured_outputs(structured)
    assert writes(compiler, structured, good)
    assert not writes(compiler, structured, bad)


# (schema, the keyword and path the refusal names): what no grammar of the engine's enforces
REFUSED = [
    ({"type": "string", "not": {"pattern": "^a"}}, "at /not: 'not'"),
    ({"type": "array", "uniqueItems": True}, "at /uniqueItems: 'uniqueItems'"),
    ({"type": "array", "contains": {"type": "integer"}, "maxContains": 2}, "'maxContains'"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "at /oneOf: its options may match"),
    ({"$ref": "https://example.com/s.json"}, "at /$ref: $ref 'https://example.com/s.json' points"),
    ({"type": "string", "pattern": "^(?!admin)"}, "at /pattern: pattern '^(?!admin)' uses a look"),
    ({"type": "string", "pattern": '^"$'}, "at /pattern: pattern '^\"$' matches no string"),
    (
        {"type": "object", "properties": {"d": {"$dynamicRef": "#x"}}},
        "at /properties/d/$dynamicRef",
    ),
    ({"type": "integer", "maximum": -(2**60)}, "beyond +-2**53"),
]


@pytest.mark.parametrize(("schema", "named"), REFUSED, ids=lambda v: json.dumps(v)[:40])
def test_what_no_grammar_enforces_is_refused_naming_the_keyword_and_path(schema, named):
    with pytest.raises(ValueError, match="JSON schema") as error:
        check_structured_outputs(spec("json", schema))
    assert named in str(error.value)


def test_pydantic_schemas_pass_whole():
    from typing import Literal

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        name: str | None = None
        tags: list[str] = []

    class Owner(BaseModel):
        pets: list[Pet]
        age: int = Field(ge=0, le=150)

    check_structured_outputs(spec("json", Owner.model_json_schema()))


def test_a_discriminated_one_of_is_enforced(compiler):
    union = {
        "oneOf": [
            {
                "type": "object",
                "properties": {"kind": {"const": k}, "n": {"type": "integer"}},
                "required": ["kind", "n"],
            }
            for k in ("a", "b")
        ]
    }
    structured = spec("json", union)
    check_structured_outputs(structured)
    assert writes(compiler, structured, '{"kind": "b", "n": 1}')
    assert not writes(compiler, structured, '{"kind": "c", "n": 1}')


@pytest.mark.parametrize(
    ("structured", "message"),
    [
        (spec("json", "{"), "not valid JSON"),
        (spec("json", '{"type": "integer", "minimum": NaN}'), "not valid JSON"),
        (spec("json", {"type": "integer", "minimum": 5, "maximum": 3}), "no integer lies between"),
        (spec("json", {"type": "object", "required": "a"}), "at /required"),
        (spec("json", [1, 2]), "an object or a boolean"),
        (spec("json", "[" * 70 + "]" * 70), "nests deeper than 64"),
        (spec("regex", "(a"), "invalid regex"),
        (spec("regex", r"(a)\1"), "Backreference"),
        (spec("grammar", "root ::= "), "invalid grammar"),
        (spec("grammar", 'root ::= b\nx ::= "a"'), 'Rule "b" is not defined'),
        (spec("choice", []), "non-empty list"),
        (spec("choice", ["a", 1]), "list of strings"),
        (spec("structural_tag", {"type": "nope"}), "invalid structural tag"),
        (spec("regex", "a" * (MAX_SPEC_CHARS + 1)), "more than the"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.kind,
)
def test_a_bad_spec_is_refused_naming_the_problem(structured, message):
    with pytest.raises(ValueError, match="structured_outputs") as error:
        check_structured_outputs(structured)
    assert message in str(error.value)


def test_choice_strings_are_matched_exactly_escapes_included(compiler):
    choices = ['say "hi"', "back\\slash", "new\nline", "naïve ☃", ""]
    structured = spec("choice", choices)
    check_structured_outputs(structured)
    for choice in choices:
        assert writes(compiler, structured, choice), choice
    assert not writes(compiler, structured, 'say "hi" ')
    assert not writes(compiler, structured, "say")


def test_regex_grammar_and_lark_compile_to_their_language(compiler):
    assert writes(compiler, spec("regex", r"[a-c]{2}\d"), "ab7")
    assert not writes(compiler, spec("regex", r"[a-c]{2}\d"), "ad7")
    ebnf = spec("grammar", 'root ::= "x" digit+\ndigit ::= [0-9]')
    assert writes(compiler, ebnf, "x12") and not writes(compiler, ebnf, "x")
    lark = spec("grammar", 'start: "x" DIGIT+\nDIGIT: /[0-9]/')
    check_structured_outputs(lark)
    assert writes(compiler, lark, "x12") and not writes(compiler, lark, "y1")


def test_json_object_is_any_object_on_one_line(compiler):
    structured = spec("json_object", "")
    assert writes(compiler, structured, '{"a": [1, {"b": null}]}')
    assert not writes(compiler, structured, "[1]")
    assert not writes(compiler, structured, '{\n"a": 1}')


def test_structural_tags_new_and_legacy_forms_and_their_schemas_are_checked(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tag = {"begin": "<f>", "content": {"type": "json_schema", "json_schema": schema}, "end": "</f>"}
    current = {"type": "structural_tag", "format": {"type": "tag", **tag}}
    legacy = {
        "type": "structural_tag",
        "structures": [{"begin": "<f>", "schema": schema, "end": "</f>"}],
        "triggers": ["<f>"],
    }
    assert writes(compiler, spec("structural_tag", current), '<f>{"a": 1}</f>')
    assert not writes(compiler, spec("structural_tag", current), '<f>{"a": "x"}</f>')
    for form in (current, legacy):
        check_structured_outputs(spec("structural_tag", form))
    assert writes(compiler, spec("structural_tag", legacy), 'text <f>{"a": 1}</f>')
    assert not writes(compiler, spec("structural_tag", legacy), '<f>{"b": 1}</f>')
    schema["properties"]["a"]["uniqueItems"] = True
    schema["properties"]["a"]["type"] = "array"
    for form in (current, legacy):
        with pytest.raises(ValueError, match="at /properties/a/uniqueItems: 'uniqueItems'"):
            check_structured_outputs(spec("structural_tag", form))
