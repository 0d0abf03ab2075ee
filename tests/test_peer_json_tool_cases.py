"""vLLM's recorded hermes, granite4 and nemotron_json outputs, read by baton's parsers whole and
streamed at every chunking (tests/parser_cases.py). Each list names the peer file and commit its
cases come from, each case the peer's test; the expectations are the peer's, except where a
comment says why baton answers otherwise."""

from __future__ import annotations

import json

import pytest

from tests.parser_cases import Case, check, output_parser

TRIGGER = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'
ONE_BRACE_SHORT = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}'

# vllm-project/vllm tests/tool_parsers/test_hermes_tool_parser.py
# @ 0eb73d6a09be117cdd0d4da4d6239321001c0d0c (vLLM runs these for hermes and granite4)
HERMES = [
    Case(
        name="test_hermes_parser_streaming_just_forward_text",
        text="This is some prior text that has nothing to do with tool calling.",
        content="This is some prior text that has nothing to do with tool calling.",
    ),
    Case(
        name="test_hermes_parser_non_streaming_tool_call_between_tags (and bug 19056)",
        text=TRIGGER,
        calls=(("final_answer", '{"trigger": true}'),),
    ),
    Case(
        name="test_hermes_parser_streaming",
        text='<tool_call>{"name": "get_current_temperature","arguments": {"location":'
        '"San Francisco, California, United States", "unit": "celsius"}}</tool_call>',
        calls=(
            (
                "get_current_temperature",
                {"location": "San Francisco, California, United States", "unit": "celsius"},
            ),
        ),
    ),
    Case(
        name="test_hermes_streaming_tool_call_with_stream_interval",
        text='<tool_call>{"name": "get_current_temperature", "arguments": {"location": '
        '"San Francisco", "unit": "celsius"}}</tool_call>',
        calls=(("get_current_temperature", {"location": "San Francisco", "unit": "celsius"}),),
    ),
    Case(
        name="test_hermes_streaming_content_then_tool_call_with_stream_interval",
        text='Sure, let me check the weather.<tool_call>{"name": "get_weather", '
        '"arguments": {"city": "NYC"}}</tool_call>',
        content="Sure, let me check the weather.",
        calls=(("get_weather", {"city": "NYC"}),),
    ),
    Case(
        name="test_hermes_streaming_multiple_tool_calls_with_stream_interval",
        text='<tool_call>{"name": "search", "arguments": {"q": "cats"}}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"q": "dogs"}}</tool_call>',
        calls=(("search", {"q": "cats"}), ("search", {"q": "dogs"})),
    ),
    Case(
        name="test_hermes_streaming_just_forward_text_with_stream_interval",
        text="This is plain text with no tool calling involved.",
        content="This is plain text with no tool calling involved.",
    ),
    Case(
        name="test_hermes_parser_non_streaming_no_tool_call",
        text="This is not a tool call.",
        content="This is not a tool call.",
    ),
    Case(
        name="test_hermes_parser_non_streaming_tool_call_until_eos",
        text=TRIGGER.removesuffix("\n</tool_call>"),
        calls=(("final_answer", '{"trigger": true}'),),
    ),
    Case(
        name="test_hermes_parser_non_streaming_tool_call_invalid_json",
        text=ONE_BRACE_SHORT,
        content=ONE_BRACE_SHORT,
    ),
    Case(
        name="test_hermes_parser_non_streaming_serialized_arguments",
        text='<tool_call>\n{"name": "get_db_config", '
        '"arguments": "{\\"param\\": \\"max_connections\\"}"}\n</tool_call>',
        calls=(("get_db_config", '{"param": "max_connections"}'),),
    ),
    Case(
        name="test_hermes_parser_non_streaming_bare_string_arguments",
        text='<tool_call>\n{"name": "do_thing", "arguments": "hello"}\n</tool_call>',
        calls=(("do_thing", '"hello"'),),
    ),
    *[
        Case(
            name=f"test_hermes_streaming_string_arguments_match_non_streaming[{value}]",
            text="<tool_call>" + json.dumps({"name": "f", "arguments": value}) + "</tool_call>",
            calls=(("f", value if value.startswith('{"param"') else json.dumps(value)),),
        )
        for value in ('{"param": "max_connections"}', "hello", "{hello world}", "[oops")
    ],
    Case(
        name="test_hermes_streaming_string_arguments_match_non_streaming[tail text]",
        text='<tool_call>{"name": "f", "arguments": "{\\"a\\": 1} tail text"}</tool_call>',
        calls=(("f", '"{\\"a\\": 1} tail text"'),),
    ),
    Case(
        name="test_hermes_streaming_content_and_tool_call_in_single_chunk",
        text='Hi!<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>',
        content="Hi!",
        calls=(("f", {"x": 1}),),
    ),
]


@pytest.mark.parametrize("parser", ["hermes", "granite4"])
@pytest.mark.parametrize("case", HERMES, ids=lambda case: case.name)
def test_vllm_hermes_case_reads_the_same_whole_and_streamed(parser, case):
    check(output_parser(parser), case)


def test_the_invalid_json_case_cut_by_the_length_limit_is_the_call_being_written():
    """The invalid-JSON case above is content; cut by max_tokens, the same text is the call the
    model was writing (only then does baton close an unfinished block)."""
    cut = Case(
        name="cut",
        text=ONE_BRACE_SHORT,
        end="length",
        calls=(("final_answer", '{"trigger": true}'),),
    )
    check(output_parser("hermes"), cut)


COORDINATES = {"coordinates": [[23.54, 43.1], [-12.2, 54.3], [4, 5]], "coordinate_type": "latlong"}
STOCK = {"symbol": "AAPL", "start_date": "2021-01-01", "end_date": "2021-12-31"}
GRANITE_TEXTS = [
    "Here goes the bbox call: \n",
    " Now the stock price call: \n ",
    " Now another bbox call: \n ",
    " See? I'm a helpful assistant.",
]
GRANITE_CALLS = [
    {"name": "find_bbox", "arguments": json.dumps(COORDINATES)},  # Granite writes a string
    {"name": "get_stock_price", "arguments": STOCK},
    {"name": "find_bbox", "arguments": json.dumps(COORDINATES)},
]

# vllm-project/vllm tests/tool_parsers/test_granite4_tool_parser.py
# @ 34f830e95846db95409c0cd6d8a168066ebd8df9
GRANITE4 = [
    Case(
        name="test_tool_call_parser_complex",
        text="".join(
            text + f"<tool_call> {json.dumps(call)} </tool_call>"
            for text, call in zip(GRANITE_TEXTS, GRANITE_CALLS, strict=False)
        )
        + GRANITE_TEXTS[-1],
        content="".join(GRANITE_TEXTS),
        calls=(("find_bbox", COORDINATES), ("get_stock_price", STOCK), ("find_bbox", COORDINATES)),
    ),
    Case(
        name="test_streaming_preserves_content_between_complete_tool_calls",
        text='<tool_call> {"name": "find_bbox", "arguments": {}} </tool_call>'
        'some explanation <tool_call> {"name": "get_stock_price", "arguments": {}} </tool_call>',
        content="some explanation ",
        calls=(("find_bbox", {}), ("get_stock_price", {})),
    ),
]


@pytest.mark.parametrize("case", GRANITE4, ids=lambda case: case.name)
def test_vllm_granite4_case_reads_the_same_whole_and_streamed(case):
    check(output_parser("granite4"), case)


THINK = "<think>\nI need the weather for Tokyo.\n</think>\n"
MALFORMED = '<TOOLCALL>[{"name": "broken", "arguments": {}</TOOLCALL>'
WEATHER_AND_TIMEZONE = (
    '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Tokyo"}}, '
    '{"name": "lookup_timezone", "arguments": {"city": "Tokyo"}}]</TOOLCALL>'
)

# vllm-project/vllm tests/tool_parsers/test_nemotron_json_tool_parser.py
# @ 32367d45e3ae37d03e9c73598406bc4e6e62fba2
NEMOTRON_JSON = [
    Case(
        name="test_extract_tool_calls_returns_content_without_tool_call",
        text="No tool call here.",
        content="No tool call here.",
    ),
    Case(
        name="test_extract_tool_calls_from_nemotron_array (and streaming)",
        text='Let me check that.<TOOLCALL>[{"name": "get_weather", '
        '"arguments": {"city": "Tokyo", "unit": "celsius"}}]</TOOLCALL>',
        content="Let me check that.",
        calls=(("get_weather", '{"city": "Tokyo", "unit": "celsius"}'),),
    ),
    Case(
        name="test_extract_tool_calls_wraps_single_object",
        text='<TOOLCALL>{"name": "lookup", "arguments": {"query": "vllm"}}</TOOLCALL>',
        calls=(("lookup", '{"query": "vllm"}'),),
    ),
    Case(
        name="test_extract_tool_calls_supports_string_arguments",
        text='<TOOLCALL>[{"name": "run_query", '
        '"arguments": "{\\"sql\\": \\"select 1\\"}"}]</TOOLCALL>',
        calls=(("run_query", '{"sql": "select 1"}'),),
    ),
    Case(
        name="test_extract_tool_calls_returns_original_for_malformed",
        text=MALFORMED,
        content=MALFORMED,
    ),
    Case(
        name="test_streaming_handles_nested_json_arguments",
        text='<TOOLCALL>[{"name": "search", "arguments": {"filters": {"city": "Tokyo"}, '
        '"items": [{"name": "rain", "value": true}]}}]</TOOLCALL>',
        calls=(
            (
                "search",
                '{"filters": {"city": "Tokyo"}, "items": [{"name": "rain", "value": true}]}',
            ),
        ),
    ),
    Case(
        name="test_extract_tool_calls_keeps_think_block_as_content (and streaming)",
        text=THINK + '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]'
        "</TOOLCALL>",
        content=THINK,
        calls=(("get_weather", '{"city": "Tokyo"}'),),
    ),
    Case(
        name="test_streaming_handles_multiple_tool_calls (and single delta)",
        text=WEATHER_AND_TIMEZONE,
        calls=(("get_weather", '{"city": "Tokyo"}'), ("lookup_timezone", '{"city": "Tokyo"}')),
    ),
    Case(
        name="test_streaming_single_delta_handles_content_and_tool_call",
        text='Let me check.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Tokyo"}}]'
        "</TOOLCALL>",
        content="Let me check.",
        calls=(("get_weather", '{"city": "Tokyo"}'),),
    ),
]


@pytest.mark.parametrize("case", NEMOTRON_JSON, ids=lambda case: case.name)
def test_vllm_nemotron_json_case_reads_the_same_whole_and_streamed(case):
    check(output_parser("nemotron_json"), case)
