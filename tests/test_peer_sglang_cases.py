"""SGLang's recorded qwen3_coder detector outputs and reasoning-parser outputs, read by baton's
parsers whole and streamed at every chunking (tests/parser_cases.py). Each list names the peer
file and commit, each case the peer's test; expectations are the peer's (SGLang compares text
with trailing whitespace stripped: the cases here give baton's exact text, equal to SGLang's
so compared), except where a comment says why baton answers otherwise."""

from __future__ import annotations

import pytest

from tests.parser_cases import Case, check, output_parser, tool

STRING = {"type": "string"}
WEATHER = tool(
    "get_current_weather", {"location": STRING, "unit": STRING, "days": {"type": "integer"}}
)
SQL = tool("sql_interpreter", {"query": STRING, "dry_run": {"type": "boolean"}})
TODOS = tool("TodoWrite", {"todos": {"type": "array"}})
BOSTON = {"location": "Boston", "unit": "celsius", "days": 3}
BOSTON_CALL = (
    "<function=get_current_weather>\n<parameter=location>Boston</parameter>\n"
    "<parameter=unit>celsius</parameter>\n<parameter=days>3</parameter>\n</function>"
)
SELECT_USERS = {"query": "SELECT * FROM users", "dry_run": True}

# sgl-project/sglang test/registered/function_call/test_qwen3_coder_detector/test_cases.py
# @ 2c5fa03198d0630444a1bfe74b4eaae310173eee (tools: test_fixtures.py @ 4e563f39802721177a146f26e266a7bca60ddcb5)
CODER_CASES = [
    Case(name="plain_text", text="This is plain text test", content="This is plain text test"),
    Case(name="single_tool_call", text=BOSTON_CALL, calls=(("get_current_weather", BOSTON),)),
    Case(
        name="single_tool_call_with_text",
        text="Text prefix + tool call test\n\n" + BOSTON_CALL,
        content="Text prefix + tool call test\n\n",
        calls=(("get_current_weather", BOSTON),),
    ),
    Case(
        name="double_tool_call",
        text="Text prefix + double tool call test\n\n<function=get_current_weather>\n"
        "<parameter=location>New York</parameter>\n</function>\n<function=sql_interpreter>\n"
        "<parameter=query>SELECT * FROM users</parameter>\n<parameter=dry_run>True</parameter>\n"
        "</function>\n",
        content="Text prefix + double tool call test\n\n",
        calls=(
            ("get_current_weather", {"location": "New York"}),
            ("sql_interpreter", SELECT_USERS),
        ),
    ),
    Case(
        name="random_fragmentation",
        text="Text prefix + random fragmentation stress test\n\n<function=get_current_weather>\n"
        "<parameter=location>San Francisco</parameter>\n</function>",
        content="Text prefix + random fragmentation stress test\n\n",
        calls=(("get_current_weather", {"location": "San Francisco"}),),
    ),
    Case(
        name="implicit_parameter_close",
        text="Text prefix + implicit parameter close test\n\n<function=get_current_weather>\n"
        "<parameter=location>Paris\n<parameter=unit>celsius\n<parameter=days>3\n</function>",
        content="Text prefix + implicit parameter close test\n\n",
        calls=(("get_current_weather", {"location": "Paris", "unit": "celsius", "days": 3}),),
    ),
    Case(  # a Python literal inside the array ('pending'): taken, as both peers take it
        name="complex_schema",
        text="Text prefix + complex schema tool call test\n\n<function=TodoWrite>\n"
        '<parameter=todos>\n[\n {"content": "Buy a new car", "status": \'pending\'},\n'
        ' {"content": "Buy a new house", "status": "completed"}\n]\n</parameter>\n'
        "</function>\n\n",
        content="Text prefix + complex schema tool call test\n\n",
        calls=(
            (
                "TodoWrite",
                {
                    "todos": [
                        {"content": "Buy a new car", "status": "pending"},
                        {"content": "Buy a new house", "status": "completed"},
                    ]
                },
            ),
        ),
    ),
]

NEW_YORK_THEN_SQL = (
    "<tool_call>\n<function=get_current_weather>\n<parameter=location>New York</parameter>\n"
    "</function>\n</tool_call>\n<tool_call>\n<function=sql_interpreter>\n"
    "<parameter=query>SELECT * FROM users</parameter>\n<parameter=dry_run>True</parameter>\n"
    "</function>\n</tool_call>"
)

# sgl-project/sglang test/registered/function_call/test_qwen3_coder_detector/
# test_qwen3_coder_detector.py @ 4e563f39802721177a146f26e266a7bca60ddcb5 (same tools)
DETECTOR_CASES = [
    Case(
        name="test_plain_text_only",
        text="This is plain text without any tool calls.",
        content="This is plain text without any tool calls.",
    ),
    Case(
        name="test_single_tool_call",
        text=f"<tool_call>\n{BOSTON_CALL}\n</tool_call>",
        calls=(("get_current_weather", BOSTON),),
    ),
    Case(
        name="test_single_tool_call_with_text_prefix",
        text="Let me check the weather for you.\n\n<tool_call>\n<function=get_current_weather>\n"
        "<parameter=location>New York</parameter>\n</function>\n</tool_call>",
        content="Let me check the weather for you.\n\n",
        calls=(("get_current_weather", {"location": "New York"}),),
    ),
    Case(
        name="test_multiple_tool_calls",
        text=NEW_YORK_THEN_SQL,
        calls=(
            ("get_current_weather", {"location": "New York"}),
            ("sql_interpreter", SELECT_USERS),
        ),
    ),
    Case(
        name="test_streaming_single_tool_call",
        text="<tool_call><function=get_current_weather><parameter=location>Boston</parameter>"
        "<parameter=unit>celsius</parameter></function></tool_call>",
        calls=(("get_current_weather", {"location": "Boston", "unit": "celsius"}),),
    ),
    Case(
        name="test_streaming_with_text_and_tool",
        text="Let me help you.\n\n<tool_call><function=get_current_weather>"
        "<parameter=location>Paris</parameter></function></tool_call>",
        content="Let me help you.\n\n",
        calls=(("get_current_weather", {"location": "Paris"}),),
    ),
    Case(
        name="test_integer_parameter_conversion",
        text="<tool_call>\n<function=get_current_weather>\n<parameter=location>Tokyo</parameter>\n"
        "<parameter=days>5</parameter>\n</function>\n</tool_call>",
        calls=(("get_current_weather", {"location": "Tokyo", "days": 5}),),
    ),
    Case(
        name="test_boolean_parameter_conversion",
        text="<tool_call>\n<function=sql_interpreter>\n<parameter=query>SELECT 1</parameter>\n"
        "<parameter=dry_run>True</parameter>\n</function>\n</tool_call>",
        calls=(("sql_interpreter", {"query": "SELECT 1", "dry_run": True}),),
    ),
    Case(
        name="test_complex_array_parameter",
        text="<tool_call>\n<function=TodoWrite>\n<parameter=todos>\n[\n"
        '  {"content": "Buy groceries", "status": "pending"},\n'
        '  {"content": "Finish report", "status": "completed"}\n]\n</parameter>\n</function>\n'
        "</tool_call>",
        calls=(
            (
                "TodoWrite",
                {
                    "todos": [
                        {"content": "Buy groceries", "status": "pending"},
                        {"content": "Finish report", "status": "completed"},
                    ]
                },
            ),
        ),
    ),
    Case(
        name="test_empty_parameter_value",
        text="<tool_call>\n<function=get_current_weather>\n<parameter=location></parameter>\n"
        "</function>\n</tool_call>",
        calls=(("get_current_weather", {"location": ""}),),
    ),
    Case(
        name="test_parameter_with_special_characters",
        text="<tool_call>\n<function=sql_interpreter>\n"
        "<parameter=query>SELECT * FROM users WHERE name = 'John \"Doe\"'</parameter>\n"
        "</function>\n</tool_call>",
        calls=(("sql_interpreter", {"query": "SELECT * FROM users WHERE name = 'John \"Doe\"'"}),),
    ),
    Case(  # SGLang asks only for no crash; baton: the call as far as it was written
        name="test_incomplete_tool_call",
        text="<tool_call>\n<function=get_current_weather>\n<parameter=location>London",
        calls=(("get_current_weather", {"location": "London"}),),
    ),
]


@pytest.mark.parametrize("case", CODER_CASES + DETECTOR_CASES, ids=lambda case: case.name)
def test_sglang_qwen3_coder_case_reads_the_same_whole_and_streamed(case):
    check(output_parser("qwen3_coder", tools=[WEATHER, SQL, TODOS]), case)


# sgl-project/sglang test/srt/function_call/test_qwen3_coder_detector.py
# @ c3df60d2a0c2aad61e87e1c4071fd36d859e0be7 (tools: get_weather with city, unit)
SRT_CASES = [
    Case(
        name="test_full_parse",
        text="<tool_call><function=get_weather><parameter=city>Shanghai</parameter>"
        "<parameter=unit>celsius</parameter></tool_call>",
        calls=(("get_weather", '{"city": "Shanghai", "unit": "celsius"}'),),
    ),
    Case(
        name="test_streaming_parse",
        text="Thought: calling weather. <tool_call><function=get_weather>"
        "<parameter=city>Shanghai</parameter></tool_call>",
        content="Thought: calling weather. ",
        calls=(("get_weather", '{"city": "Shanghai"}'),),
    ),
]


@pytest.mark.parametrize("case", SRT_CASES, ids=lambda case: case.name)
def test_sglang_srt_qwen3_coder_case_reads_the_same_whole_and_streamed(case):
    check(
        output_parser("qwen3_coder", tools=[tool("get_weather", {"city": STRING, "unit": STRING})]),
        case,
    )


def test_a_call_to_a_function_the_request_does_not_name_is_still_a_call():
    """sgl-project/sglang test/registered/function_call/test_unknown_tool_name.py
    @ 1ee37b4912c6da7d7a22a94d477a04a61623e0d2 drops it by default (forwards it with
    SGLANG_FORWARD_UNKNOWN_TOOLS); baton forwards it, as vLLM does: the agent can tell the model
    that no such tool exists, where a dropped call leaves an answer with nothing in it."""
    text = '<tool_call>{"name":"unknown_tool","parameters":{"city":"Paris"}}</tool_call>'
    case = Case(name="forwarded", text=text, calls=(("unknown_tool", {"city": "Paris"}),))
    check(output_parser("hermes", tools=[tool("get_weather", {})]), case)
