"""Tool-call and reasoning parsers on recorded texts in each format: the whole-text parse is
checked against what the text means, and the text streamed in every way (one character at a
time, and cut in two at every character boundary) gives deltas that concatenate to it."""

from __future__ import annotations

import json

import pytest

from baton.server.parsers.output import OutputParser, OutputStream, ParsedOutput
from baton.server.parsers.reasoning import REASONING_FORMATS, ReasoningSplitter, starts_thinking
from baton.server.parsers.tools import BareJsonParser, make_tool_parser, typed_value

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


def _parser(tool_parser: str | None, reasoning: str | None = None, thinking: bool = True):
    def make() -> OutputParser:
        splitter = ReasoningSplitter(REASONING_FORMATS[reasoning], thinking) if reasoning else None
        if tool_parser is None:
            tools = None
        elif tool_parser.startswith("bare:"):
            name = tool_parser[len("bare:") :]
            tools = BareJsonParser(name or None)
        else:
            tools = make_tool_parser(tool_parser, WEATHER_TOOLS)
        return OutputParser(splitter, tools)

    return make


def _streamed(make, pieces: list[str]) -> ParsedOutput:
    """Feed `pieces` as deltas; rebuild the message from the deltas alone."""
    stream = OutputStream(make())
    reasoning, content, calls = "", "", {}
    text = ""
    for number, piece in enumerate(pieces):
        text += piece
        delta = stream.update(text, final=number == len(pieces) - 1)
        reasoning += delta.reasoning
        content += delta.content
        for entry in delta.tool_calls:
            if "id" in entry:
                assert entry["type"] == "function" and entry["function"]["name"]
                assert entry["index"] == len(calls), "calls open in order"
                calls[entry["index"]] = [entry["function"]["name"], ""]
            calls[entry["index"]][1] += entry["function"]["arguments"]
    return reasoning, content, [tuple(call) for call in calls.values()]


def _whole(make, text: str):
    parsed = make().parse(text, final=True)
    return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.calls]


RECORDED = {
    "hermes: content then two calls (Qwen3)": (
        "hermes",
        None,
        'Let me look.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}\n</tool_call>\n<tool_call>\n{"name":"get_weather","arguments":'
        '{"city":"Lyon \\"Gones\\"","hours":[1,2.5e1,-3]}}\n</tool_call>',
        (
            "",
            "Let me look.",
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
        ("", "  a < b and c <tool but no call\n", []),
    ),
    "granite4: text after a call stays content": (
        "granite4",
        None,
        '<tool_call>{"name": "get_weather", "arguments": {"metric": true, "city": null}}'
        "</tool_call>\nDone.",
        ("", "Done.", [("get_weather", '{"metric": true, "city": null}')]),
    ),
    "hermes: a block that is not a call is content": (
        "hermes",
        None,
        "Try <tool_call>not json</tool_call> then",
        ("", "Try<tool_call>not json</tool_call>then", []),
    ),
    "hermes: cut inside the arguments by a length limit": (
        "hermes",
        None,
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
        ("", "", [("get_weather", '{"city": "Par')]),
    ),
    "hermes: arguments before name, none at all": (
        "hermes",
        None,
        '<tool_call>{"arguments": {"days": 10}, "name": "get_weather"}</tool_call>'
        '<tool_call>{"name": "get_weather"}</tool_call>',
        ("", "", [("get_weather", '{"days": 10}'), ("get_weather", "{}")]),
    ),
    "nemotron_json: reasoning then a list of calls (Nemotron Nano 9B v2)": (
        "nemotron_json",
        "deepseek_r1",
        '<think>\nThe user wants weather.\n</think>\n\n<TOOLCALL>[{"name": "get_weather", '
        '"arguments": {"city": "Oslo"}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
        "</TOOLCALL>",
        (
            "\nThe user wants weather.\n",
            "",
            [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')],
        ),
    ),
    "qwen3_coder: reasoning, XML call typed by the schema (Nemotron 3, Qwen3.5)": (
        "qwen3_coder",
        "nemotron_v3",
        "I should call it.\n</think>\nSure.\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nSão Paulo\n</parameter>\n<parameter=days>\n7\n</parameter>\n"
        "<parameter=metric>\nfalse\n</parameter>\n<parameter=hours>\n[6, 12]\n</parameter>\n"
        "<parameter=note>\n42\n</parameter>\n</function>\n</tool_call>",
        (
            "I should call it.\n",
            "\nSure.",
            [
                (
                    "get_weather",
                    '{"city": "São Paulo", "days": 7, "metric": false, "hours": [6, 12], '
                    '"note": "42"}',
                )
            ],
        ),
    ),
    "qwen3_coder: <tool_call><function= ends the reasoning without </think>": (
        "qwen3_coder",
        "qwen3",
        "thinking <tool_call> is a tag\n<tool_call>\n<function=get_weather>\n"
        "<parameter=days>\nmany\n</parameter>\n</function>\n</tool_call>",
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
        ("\nstep one </thi", "", []),
    ),
    "deepseek_r1: start tag written by the template": (
        None,
        "deepseek_r1",
        "so 2+2=4</think>The answer is 4.",
        ("so 2+2=4", "The answer is 4.", []),
    ),
    "required: the grammar's array of {name, parameters}": (
        "bare:",
        None,
        ' [{"name": "get_weather", "parameters": {"city": "Kyiv"}}, '
        '{"name": "get_weather", "parameters": {"days": 2}}]',
        ("", "", [("get_weather", '{"city": "Kyiv"}'), ("get_weather", '{"days": 2}')]),
    ),
    "named: the arguments object, after reasoning": (
        "bare:get_weather",
        "deepseek_r1",
        'hmm</think>{ "city" : "Tunis" ,"days":1 }',
        ("hmm", "", [("get_weather", '{"city": "Tunis", "days": 1}')]),
    ),
    "named: output that is not JSON is content": (
        "bare:get_weather",
        None,
        "I will not.",
        ("", "I will not.", []),
    ),
}


@pytest.mark.parametrize("case", list(RECORDED))
def test_whole_text_parse_reads_the_recorded_output(case):
    tool_parser, reasoning, text, expected = RECORDED[case]
    assert _whole(_parser(tool_parser, reasoning), text) == expected


@pytest.mark.parametrize("case", list(RECORDED))
def test_streamed_deltas_concatenate_to_the_whole_text_parse(case):
    tool_parser, reasoning, text, _ = RECORDED[case]
    make = _parser(tool_parser, reasoning)
    whole = _whole(make, text)
    assert _streamed(make, list(text)) == whole  # every boundary at once
    for cut in range(len(text) + 1):  # each boundary alone
        assert _streamed(make, [text[:cut], text[cut:]]) == whole, cut


def test_finished_arguments_are_json_that_validates():
    for name, case in RECORDED.items():
        _, _, calls = _whole(_parser(case[0], case[1]), case[2])
        for _, arguments in calls:
            if "length limit" not in name:
                assert isinstance(json.loads(arguments), dict), name


def test_answer_after_a_closed_thinking_block_is_content_unless_it_opens_one():
    qwen3 = REASONING_FORMATS["qwen3"]
    assert not starts_thinking(qwen3, "<|im_start|>assistant\n<think>\n\n</think>\n\n", {})
    assert starts_thinking(qwen3, "<|im_start|>assistant\n<think>\n", {})
    assert not starts_thinking(qwen3, "<|im_start|>assistant\n", {"enable_thinking": False})
    assert starts_thinking(REASONING_FORMATS["deepseek_r1"], "x", {"enable_thinking": False})
    answering = _parser(None, "qwen3", thinking=False)
    assert _whole(answering, "plain") == ("", "plain", [])
    assert _whole(answering, "\n<think>again</think>ok") == ("again", "ok", [])
    for cut in range(12):
        text = "\n<think>again</think>ok"
        assert _streamed(answering, [text[:cut], text[cut:]]) == ("again", "ok", [])


@pytest.mark.parametrize(
    ("value", "schema_type", "expected"),
    [
        ("7", "integer", "7"),
        ("7.5", "integer", '"7.5"'),
        ("7.0", "number", "7"),
        ("inf", "number", '"inf"'),
        ("True", "boolean", "true"),
        ('{"a": 1}', "object", '{"a": 1}'),
        ("[1]", "object", '"[1]"'),
        ("null", ["string", "null"], "null"),
        ("x", None, '"x"'),
    ],
)
def test_xml_parameter_values_follow_the_schema_type(value, schema_type, expected):
    assert typed_value(value, schema_type) == expected
