"""vLLM's recorded qwen3_coder outputs (test_qwen3coder_tool_parser.py; the cases it shares with
qwen3_xml are in tests/test_peer_xml_shared_cases.py), read by baton's qwen3_coder parser whole and streamed at every chunking (tests/parser_cases.py).
Each list names the peer file and commit, each case the peer's test; expectations are the
peer's, except where a comment says why baton answers otherwise. SGLang's are in
tests/test_peer_sglang_cases.py."""

from __future__ import annotations

import pytest

from tests.parser_cases import Case, check, output_parser, tool

STRING = {"type": "string"}
WEATHER = tool("get_current_weather", {"city": STRING, "state": STRING, "unit": STRING})
AREA = tool(
    "calculate_area",
    {"shape": STRING, "dimensions": {"type": "object"}, "precision": {"type": "integer"}},
)


def call(name: str, *parameters: tuple[str, str], head: str = "", tail: str = "") -> str:
    """A qwen3_coder block as Qwen3-Coder lays it out (a newline around each value)."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"{head}<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>{tail}"


DALLAS = call("get_current_weather", ("city", "Dallas"), ("state", "TX"), ("unit", "fahrenheit"))
DALLAS_ARGS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}
MISSING_CLOSE = (
    "Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n"
    "<parameter=city>\nDallas\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\n"
    "fahrenheit\n</parameter>\n</function>\n</tool_call>"
)
NO_GT = (
    "<tool_call>\n<function=get_current_weather\n<parameter=city>Dallas</parameter>\n"
    "</function>\n</tool_call>"
)
BAD_NAME = "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n"

# vllm-project/vllm tests/tool_parsers/test_qwen3coder_tool_parser.py
# @ 049d8df27dda4fd0caffa289ea12bfe5a47ac794, with its tools get_current_weather, calculate_area
CODER = [
    Case(
        name="test_extract_tool_calls_no_tools",
        text="This is a test response without any tool calls",
        content="This is a test response without any tool calls",
    ),
    Case(
        name="test_extract_tool_calls[single_tool]",
        text=DALLAS,
        calls=(("get_current_weather", DALLAS_ARGS),),
    ),
    Case(
        name="test_extract_tool_calls[single_tool_with_content]",
        text="Sure! Let me check the weather for you." + DALLAS,
        content="Sure! Let me check the weather for you.",
        calls=(("get_current_weather", DALLAS_ARGS),),
    ),
    Case(
        name="test_extract_tool_calls[single_tool_multiline_param]",
        text=call(
            "calculate_area",
            ("shape", "rectangle"),
            ("dimensions", '{"width": 10, \n "height": 20}'),
            ("precision", "2"),
        ),
        calls=(
            (
                "calculate_area",
                {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2},
            ),
        ),
    ),
    Case(
        name="test_extract_tool_calls_streaming[parallel_tools]",
        text=DALLAS
        + "\n"
        + call("get_current_weather", ("city", "Orlando"), ("state", "FL"), ("unit", "celsius")),
        calls=(
            ("get_current_weather", DALLAS_ARGS),
            ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "celsius"}),
        ),
    ),
    Case(
        name="test_extract_tool_calls[tool_with_typed_params]",
        text=call(
            "calculate_area",
            ("shape", "circle"),
            ("dimensions", '{"radius": 15.5}'),
            ("precision", "3"),
            head="Let me calculate that area for you.",
        ),
        content="Let me calculate that area for you.",
        calls=(
            ("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3}),
        ),
    ),
    Case(
        name="test_extract_tool_calls_fallback_no_tags",
        text="<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n"
        "<parameter=state>\nTX\n</parameter>\n</function>",
        calls=(("get_current_weather", {"city": "Dallas", "state": "TX"}),),
    ),
    Case(
        name="test_extract_tool_calls_missing_closing_parameter_tag (and streaming)",
        text=MISSING_CLOSE,
        content="Let me check the weather for you:\n",
        calls=(("get_current_weather", DALLAS_ARGS),),
    ),
    Case(
        name="test_extract_tool_calls_streaming_incremental",
        text="I'll check the weather."
        + call("get_current_weather", ("city", "Dallas"), ("state", "TX")),
        content="I'll check the weather.",
        calls=(("get_current_weather", {"city": "Dallas", "state": "TX"}),),
    ),
    Case(
        name="test_extract_tool_calls_streaming_missing_opening_tag",
        text="I'll check the weather for you.\n\n" + DALLAS.removeprefix("<tool_call>\n"),
        content="I'll check the weather for you.\n\n",
        calls=(("get_current_weather", DALLAS_ARGS),),
    ),
    # vLLM only asks for no crash; baton: a name cut by a tag makes the tags text
    Case(name="test_malformed_xml_no_gt_delimiter", text=NO_GT, content=NO_GT),
    Case(
        name="test_none_tool_calls_filtered",
        text=BAD_NAME
        + "<tool_call>\n<function=get_current_weather>\n<parameter=city>Dallas</parameter>\n"
        "<parameter=state>TX</parameter>\n</function>\n</tool_call>",
        content=BAD_NAME,
        calls=(("get_current_weather", {"city": "Dallas", "state": "TX"}),),
    ),
]


@pytest.mark.parametrize("case", CODER, ids=lambda case: case.name)
def test_vllm_qwen3_coder_case_reads_the_same_whole_and_streamed(case):
    check(output_parser("qwen3_coder", tools=[WEATHER, AREA]), case)


TYPES = tool(
    "test_types",
    {
        "int_param": {"type": "integer"},
        "float_param": {"type": "float"},  # not a JSON Schema type: read as "number"
        "bool_param": {"type": "boolean"},
        "str_param": STRING,
        "obj_param": {"type": "object"},
    },
)


def nullable(kind: str) -> dict:
    return {"anyOf": [{"type": kind}, {"type": "null"}]}


ANY_OF = tool(
    "test_anyof",
    {
        "anyof_int": {**nullable("integer"), "default": 5},
        "anyof_str": nullable("string"),
        "anyof_array": {"anyOf": [{"type": "array", "items": STRING}, {"type": "null"}]},
        "anyof_obj": nullable("object"),
        "type_as_array": {"type": ["integer", "null"]},
        "multi_non_null": {"anyOf": [STRING, {"type": "integer"}, {"type": "null"}]},
    },
)
SEARCH_WEB = tool(
    "search_web",
    {"query": nullable("string"), "count": nullable("integer"), "verbose": nullable("boolean")},
)
UPDATE_RECORD = tool("update_record", {"data": nullable("object")})
GREET = tool("greet", {"message": STRING})


# The same file, cases with their own tools: (tools, case)
CODER_TYPED = [
    (
        [TYPES],
        Case(
            name="test_extract_tool_calls_type_conversion",
            text=call(
                "test_types",
                ("int_param", "42"),
                ("float_param", "3.14"),
                ("bool_param", "true"),
                ("str_param", "hello world"),
                ("obj_param", '{"key": "value"}'),
            ),
            calls=(
                (
                    "test_types",
                    {
                        "int_param": 42,
                        "float_param": 3.14,
                        "bool_param": True,
                        "str_param": "hello world",
                        "obj_param": {"key": "value"},
                    },
                ),
            ),
        ),
    ),
    (
        [ANY_OF],
        Case(
            name="test_extract_tool_calls_anyof_type_conversion",
            text=call(
                "test_anyof",
                ("anyof_int", "5"),
                ("anyof_str", "hello"),
                ("anyof_array", '["a", "b", "c"]'),
                ("anyof_obj", '{"key": "value"}'),
                ("type_as_array", "42"),
                ("multi_non_null", "some text"),
            ),
            calls=(
                (
                    "test_anyof",
                    {
                        "anyof_int": 5,
                        "anyof_str": "hello",
                        "anyof_array": ["a", "b", "c"],
                        "anyof_obj": {"key": "value"},
                        "type_as_array": 42,
                        "multi_non_null": "some text",
                    },
                ),
            ),
        ),
    ),
    (
        [SEARCH_WEB],
        Case(
            name="test_extract_tool_calls_anyof_type_conversion_streaming",
            text=call(
                "search_web", ("query", "vllm tool parser"), ("count", "10"), ("verbose", "true")
            ),
            calls=(("search_web", {"query": "vllm tool parser", "count": 10, "verbose": True}),),
        ),
    ),
    (
        [UPDATE_RECORD],
        Case(
            name="test_anyof_parameter_not_double_encoded",
            text="<tool_call>\n<function=update_record>\n"
            '<parameter=data>{"key": "value", "count": 42}</parameter>\n</function>\n</tool_call>',
            calls=(("update_record", {"data": {"key": "value", "count": 42}}),),
        ),
    ),
    (
        [GREET],
        Case(
            name="test_no_double_serialization_string_args",
            text="<tool_call>\n<function=greet>\n<parameter=message>hello world</parameter>\n"
            "</function>\n</tool_call>",
            calls=(("greet", '{"message": "hello world"}'),),
        ),
    ),
]


@pytest.mark.parametrize(("tools", "case"), CODER_TYPED, ids=lambda item: getattr(item, "name", ""))
def test_vllm_qwen3_coder_typed_case_reads_the_same_whole_and_streamed(tools, case):
    check(output_parser("qwen3_coder", tools=tools), case)
