"""Tool-call and reasoning parsers on recorded texts in each format: the whole-text parse is
checked against what the text means, and the text streamed at every chunking gives deltas that
rebuild it (tests/parser_cases.py). The peers' own recorded cases are in
tests/test_peer_*_cases.py."""

from __future__ import annotations

import json

import pytest

from baton.server.parsers.blocks import text_end
from baton.server.parsers.param_types import declared_types, typed_value
from baton.server.parsers.reasoning import REASONING_FORMATS, starts_thinking
from tests.parser_cases import Parsed, output_parser, parse_every_way, whole

WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                },
            },
        },
    }
]


RECORDED = {
    "hermes: content then two calls (Qwen3)": (
        "hermes",
        None,
        'Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}\n</tool_call>\n<tool_call>\n{"name":"get_weather","arguments":'
        '{"city":"Lyon \\"Gones\\"","hours":[1,2.5e1,-3]}}\n</tool_call>',
        "stop",
        (
            "",
            "Let me look.\n\n",
            [
                ("get_weather", '{"city": "Paris", "days": 3}'),
                ("get_weather", '{"city": "Lyon \\"Gones\\"", "hours": [1, 2.5e1, -3]}'),
            ],
        ),
    ),
    "hermes: plain answer keeps its whitespace and stray '<'": (
        "hermes",
        None,
        "  a < b and c <tool but no call\n",
        "stop",
        ("", "  a < b and c <tool but no call\n", []),
    ),
    "granite4: text after a call stays content, as written": (
        "granite4",
        None,
        '<tool_call>{"name": "get_weather", "arguments": {"metric": true, "city": null}}'
        "</tool_call>\nDone.",
        "stop",
        ("", "\nDone.", [("get_weather", '{"metric": true, "city": null}')]),
    ),
    "hermes: a tag before what is not JSON is text": (
        "hermes",
        None,
        "Try <tool_call>not json</tool_call> then",
        "stop",
        ("", "Try <tool_call>not json</tool_call> then", []),
    ),
    "hermes: an end tag inside an argument does not end the block": (
        "hermes",
        None,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "</tool_call>"}}</tool_call>',
        "stop",
        ("", "", [("get_weather", '{"city": "</tool_call>"}')]),
    ),
    "hermes: a name no function has is not a call": (
        "hermes",
        None,
        '<tool_call>{"name": "bad\\n</function", "arguments": {}}</tool_call>',
        "stop",
        ("", '<tool_call>{"name": "bad\\n</function", "arguments": {}}</tool_call>', []),
    ),
    "hermes: cut inside the arguments by the length limit": (
        "hermes",
        None,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        "length",
        ("", "", [("get_weather", '{"city": "Par')]),
    ),
    "hermes: the same text ended by the model is not a call": (
        "hermes",
        None,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        "stop",
        ("", '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', []),
    ),
    "hermes: arguments before name, none at all": (
        "hermes",
        None,
        '<tool_call>{"arguments": {"days": 10}, "name": "get_weather"}</tool_call>'
        '<tool_call>{"name": "get_weather"}</tool_call>',
        "stop",
        ("", "", [("get_weather", '{"days": 10}'), ("get_weather", "{}")]),
    ),
    "nemotron_json: reasoning then a list of calls (Nemotron Nano 9B v2)": (
        "nemotron_json",
        "deepseek_r1",
        '<think>\nThe user wants weather.\n</think>\n\n<TOOLCALL>[{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
        "</TOOLCALL>",
        "stop",
        (
            "\nThe user wants weather.\n",
            "",
            [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')],
        ),
    ),
    "nemotron_json: a list cut short keeps its whole calls, the rest is content": (
        "nemotron_json",
        None,
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "get_w',
        "stop",
        ("", '{"name": "get_w', [("get_weather", '{"city": "Oslo"}')]),
    ),
    "qwen3_coder: reasoning, XML call typed by the schema (Nemotron 3, Qwen3.5)": (
        "qwen3_coder",
        "nemotron_v3",
        "I should call it.\n</think>\nSure.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n7\n</parameter>\n"
        "<parameter=metric>\nfalse\n</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n"
        "</function>\n</tool_call>",
        "stop",
        (
            "I should call it.\n",
            "\nSure.\n",
            [
                (
                    "get_weather",
                    '{"city": "São Paulo", "days": 7, "metric": false, "hours": [6, 12]}',
                )
            ],
        ),
    ),
    "qwen3_coder: a parameter the schema does not declare is a string": (
        "qwen3_coder",
        None,
        "<tool_call>\n<function=other>\n<parameter=note>\n42\n</parameter>\n</function>\n"
        "</tool_call>",
        "stop",
        ("", "", [("other", '{"note": "42"}')]),
    ),
    "qwen3_coder: <tool_call><function= ends the reasoning without </think>": (
        "qwen3_coder",
        "qwen3",
        "thinking <tool_call> is a tag\n<tool_call>\n<function=get_weather>\n"
        "<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call>",
        "stop",
        (
            "thinking <tool_call> is a tag\n",
            "",
            [("get_weather", '{"days": "many"}')],
        ),
    ),
    "qwen3: reasoning cut by a length limit is all reasoning": (
        None,
        "qwen3",
        "<think>\nstep one </thi",
        "length",
        ("\nstep one </thi", "", []),
    ),
    "deepseek_r1: start tag written by the template": (
        None,
        "deepseek_r1",
        "so 2+2=4</think>The answer is 4.",
        "stop",
        ("so 2+2=4", "The answer is 4.", []),
    ),
    "required: the grammar's array of {name, parameters}": (
        "bare:",
        None,
        ' [{"name": "get_weather", "parameters": {"city": "Kyiv"}}, '
        '{"name": "get_weather", "parameters": {"days": 2}}]',
        "stop",
        ("", "", [("get_weather", '{"city": "Kyiv"}'), ("get_weather", '{"days": 2}')]),
    ),
    "named: the arguments object, after reasoning": (
        "bare:get_weather",
        "deepseek_r1",
        'hmm</think>{ "city" : "Tunis" ,"days":1 }',
        "stop",
        ("hmm", "", [("get_weather", '{"city": "Tunis", "days": 1}')]),
    ),
    "named: output that is not JSON is content": (
        "bare:get_weather",
        None,
        "I will not.",
        "stop",
        ("", "I will not.", []),
    ),
}


def _make(tool_parser, reasoning, thinking=True):
    return output_parser(tool_parser, reasoning, thinking=thinking, tools=WEATHER_TOOLS)


@pytest.mark.parametrize("case", list(RECORDED))
def test_recorded_output_parses_to_its_meaning_whole_and_streamed(case):
    tool_parser, reasoning, text, end, (reasoning_text, content, calls) = RECORDED[case]
    expected = Parsed(reasoning=reasoning_text, content=content, calls=tuple(calls))
    assert parse_every_way(_make(tool_parser, reasoning), text, end) == expected


def test_the_text_ends_as_the_engine_finished_it():
    assert text_end(False, None) == "open"
    assert text_end(True, "length") == "length"
    assert text_end(True, "stop") == text_end(True, "abort") == "stop"


def test_finished_arguments_are_json_objects():
    for name, (tool_parser, reasoning, text, end, _) in RECORDED.items():
        for _, arguments in whole(_make(tool_parser, reasoning), text, end).calls:
            if end != "length":
                assert isinstance(json.loads(arguments), dict), name


def test_answer_after_a_closed_thinking_block_is_content_unless_it_opens_one():
    qwen3 = REASONING_FORMATS["qwen3"]
    assert not starts_thinking(qwen3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", {})
    assert starts_thinking(qwen3, "<|im_start|>assistant\n<think>\n", {})
    assert not starts_thinking(qwen3, "<|im_start|>assistant\n", {"enable_thinking": False})
    assert starts_thinking(REASONING_FORMATS["deepseek_r1"], "x", {"enable_thinking": False})
    answering = _make(None, "qwen3", thinking=False)
    assert parse_every_way(answering, "plain") == Parsed(reasoning="", content="plain", calls=())
    again = parse_every_way(answering, "\n<think>again</think>ok")
    assert again == Parsed(reasoning="again", content="ok", calls=())


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("7", {"type": "integer"}, "7"),
        ("7.5", {"type": "integer"}, '"7.5"'),
        ("7.0", {"type": "number"}, "7"),
        ("3.14", {"type": "float"}, "3.14"),
        ("inf", {"type": "number"}, '"inf"'),
        ("True", {"type": "boolean"}, "true"),
        ("yes", {"type": "boolean"}, '"yes"'),
        ('{"a": 1}', {"type": "object"}, '{"a": 1}'),
        ("{'a': None}", {"type": "object"}, '{"a": null}'),
        ("{'a': {1, 2}}", {"type": "object"}, "\"{'a': {1, 2}}\""),
        ("[NaN]", {"type": "array"}, '"[NaN]"'),
        ("[1]", {"type": "object"}, '"[1]"'),
        ("[" * 5000, {"type": "array"}, json.dumps("[" * 5000)),
        ("null", {"type": ["string", "null"]}, "null"),
        ("None", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "null"),
        ("42", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, "42"),
        ("42", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, '"42"'),
        ("null", {"type": "string"}, '"null"'),
        ("x", None, '"x"'),
    ],
)
def test_xml_parameter_values_follow_the_schema_type(value, schema, expected):
    assert typed_value(value, declared_types(schema)) == expected


def test_arguments_nested_past_the_stack_stay_text_not_a_crash():
    deep = "[" * 100_000 + "]" * 100_000
    assert typed_value(deep, ("array",)) == json.dumps(deep)
    hermes = _make("hermes", None)
    text = '<tool_call>{"name": "f", "arguments": "' + deep + '"}</tool_call>'
    assert whole(hermes, text).calls == (("f", json.dumps(deep)),)
