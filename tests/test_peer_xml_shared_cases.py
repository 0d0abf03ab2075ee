"""The cases vLLM shares between its qwen3_xml and qwen3_coder parsers, read by baton's
qwen3_coder parser whole and streamed at every chunking (tests/parser_cases.py): typed values,
and values that hold the format's own tags as text (an agent writing a parser's fixture)."""

from __future__ import annotations

import pytest

from tests.parser_cases import Case, check, output_parser, tool

STRING = {"type": "string"}
WRITE_FILE = tool("write_file", {"path": STRING, "content": STRING})
WEATHER = tool("get_weather", {"city": STRING})


def nullable(kind: str) -> dict:
    return {"anyOf": [{"type": kind}, {"type": "null"}]}


def block(name: str, *parameters: tuple[str, str], inline: bool = False) -> str:
    """A block with each value on its own lines (or `inline`, tight against the tags)."""
    layout = "<parameter={}>{}</parameter>\n" if inline else "<parameter={}>\n{}\n</parameter>\n"
    body = "".join(layout.format(key, value) for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def write_file(content: str, path: str = "test.py") -> str:
    """write_file with `content` written as is (it ends with its own newline)."""
    return (
        f"<tool_call>\n<function=write_file>\n<parameter=path>\n{path}\n</parameter>\n"
        f"<parameter=content>\n{content}</parameter>\n</function>\n</tool_call>"
    )


XML_TAGS_IN_CONTENT = (
    'char_deltas = [\n    "<tool_call>\\n",\n    "<parameter=query>\\n",\n'
    '    "\\n</parameter>\\n",\n    "</function>\\n",\n]\n'
)
PARAM_LIKE_LINES = (
    'TOOL_CALL_TEMPLATE = """\n</parameter>\n<parameter=new_string>\n#!/usr/bin/env python3\n'
    '</parameter>\n"""\n'
)
REAL_PARAM_NAME_LITERAL = 'doc = """\n<parameter=path>\nliteral/value\n</parameter>\n"""\n'
FULL_NESTED_CALL = (
    'doc = """\n<tool_call>\n<function=write_file>\n<parameter=path>\nliteral/value.txt\n'
    '</parameter>\n<parameter=content>\nhello\n</parameter>\n</function>\n</tool_call>\n"""\n'
)
OUT_OF_SCHEMA_NESTED = (
    'template = """\n<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n'
    '</function>\n</tool_call>\n"""\n'
)
FOO = "<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n</function>\n</tool_call>"
PARIS, LONDON = block("get_weather", ("city", "Paris")), block("get_weather", ("city", "London"))
JINJA = (
    "<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
    "</function>\n</tool_call>\n\n"
)

# vllm-project/vllm tests/tool_parsers/test_qwen3_xml_coder_shared.py
# @ 00d0a333ba9b8e40eb35fc0b54b4ae96114f30b3: (the request's tools, case)
SHARED = [
    (
        [tool("test_types", {"obj_param": {"type": "object"}})],
        Case(
            name="test_extract_tool_calls_complex_type_with_single_quote",
            text=block("test_types", ("obj_param", "{'key': 'value'}")),
            calls=(("test_types", {"obj_param": {"key": "value"}}),),
        ),
    ),
    (
        [WEATHER],
        Case(
            name="test_extract_tool_calls_streaming_speculative_decode_loss",
            text=block("test", ("city", "Paris")),
            calls=(("test", {"city": "Paris"}),),
        ),
    ),
    (
        [tool("search", {"query": STRING})],
        Case(
            name="test_string_null_value_preserved",
            text=block("search", ("query", "null"), inline=True),
            calls=(("search", {"query": "null"}),),
        ),
    ),
    (
        [tool("set_code", {"code": nullable("string")})],
        Case(
            name="test_anyof_string_null_keeps_value_as_string",
            text=block("set_code", ("code", "42"), inline=True),
            calls=(("set_code", {"code": "42"}),),
        ),
    ),
    (
        [tool("set_count", {"count": nullable("integer")})],
        Case(
            name="test_anyof_integer_null_parses_as_int",
            text=block("set_count", ("count", "42"), inline=True),
            calls=(("set_count", {"count": 42}),),
        ),
    ),
    (
        [tool("set_count", {"count": nullable("integer")})],
        Case(
            name="test_python_none_value_for_nullable_int",
            text=block("set_count", ("count", "None"), inline=True),
            calls=(("set_count", {"count": None}),),
        ),
    ),
    *[
        (
            [tool("set_value", {"optional": nullable("string")})],
            Case(
                name=f"test_anyof_string_null_with_null_literal_returns_none[{literal}]",
                text=block("set_value", ("optional", literal), inline=True),
                calls=(("set_value", {"optional": None}),),
            ),
        )
        for literal in ("null", "None")
    ],
    (
        [tool("pick", {"items": {"type": "array"}})],
        Case(
            name="test_array_with_json_bool",
            text=block("pick", ("items", '["a", "b", 1, true]')),
            calls=(("pick", {"items": ["a", "b", 1, True]}),),
        ),
    ),
    (
        [WRITE_FILE],
        Case(
            name="test_content_with_xml_structural_tags_nonstreaming (and streaming)",
            text=write_file(XML_TAGS_IN_CONTENT) + "\n",
            calls=(("write_file", {"path": "test.py", "content": XML_TAGS_IN_CONTENT[:-1]}),),
        ),
    ),
    (
        [WRITE_FILE],
        Case(
            name="test_content_with_param_like_lines_nonstreaming (and streaming)",
            text=write_file(PARAM_LIKE_LINES, "test_template.py") + "\n",
            calls=(("write_file", {"path": "test_template.py", "content": PARAM_LIKE_LINES[:-1]}),),
        ),
    ),
    (
        [WRITE_FILE],
        Case(
            name="test_content_with_real_param_name_literal_nonstreaming (and streaming)",
            text=write_file(REAL_PARAM_NAME_LITERAL, "fixture.py"),
            calls=(
                ("write_file", {"path": "fixture.py", "content": REAL_PARAM_NAME_LITERAL[:-1]}),
            ),
        ),
    ),
    (
        [WRITE_FILE],
        Case(
            name="test_content_with_full_nested_tool_call_nonstreaming (and streaming)",
            text=write_file(FULL_NESTED_CALL, "fixture.py"),
            calls=(("write_file", {"path": "fixture.py", "content": FULL_NESTED_CALL[:-1]}),),
        ),
    ),
    (
        [WRITE_FILE],
        Case(
            name="test_two_tools_second_with_out_of_schema_nested_literal_nonstreaming",
            text=FOO + "\n\n" + write_file(OUT_OF_SCHEMA_NESTED, "fixture.py"),
            calls=(
                ("foo", {"bar": "baz"}),
                ("write_file", {"path": "fixture.py", "content": OUT_OF_SCHEMA_NESTED[:-1]}),
            ),
        ),
    ),
    (
        [WEATHER],
        Case(
            name="test_two_tool_calls_in_one_streaming_chunk",
            text=PARIS + "\n" + LONDON,
            calls=(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})),
        ),
    ),
    (
        [WEATHER],
        Case(
            name="test_streaming_two_tool_calls_plus_trailing_text_one_delta",
            text=PARIS + "\n" + LONDON + "\nAll done!",
            content="\nAll done!",
            calls=(("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})),
        ),
    ),
    (
        [WEATHER],
        Case(
            name="test_streaming_trailing_text_with_final_close_in_same_delta",
            text="<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n"
            "</function>\n</tool_call>\nI hope this helps!",
            content="\nI hope this helps!",
            calls=(("get_weather", {"city": "Paris"}),),
        ),
    ),
    (
        [WRITE_FILE],
        Case(
            name="test_jinja_template_phantom_tool_call_is_rejected_nonstreaming",
            text=JINJA + block("write_file", ("path", "out.txt"), ("content", "hello")),
            content=JINJA,
            calls=(("write_file", {"path": "out.txt", "content": "hello"}),),
        ),
    ),
    (
        [tool("log", {"msg": STRING})],
        Case(
            name="test_inline_empty_tool_call_preserves_content_before_real_call",
            text="I'll show: <tool_call>example</tool_call>. Now real:\n"
            + block("log", ("msg", "hi")),
            content="I'll show: <tool_call>example</tool_call>. Now real:\n",
            calls=(("log", {"msg": "hi"}),),
        ),
    ),
]


@pytest.mark.parametrize(("tools", "case"), SHARED, ids=lambda item: getattr(item, "name", ""))
def test_vllm_shared_xml_case_reads_the_same_whole_and_streamed(tools, case):
    check(output_parser("qwen3_coder", tools=tools), case)


def test_a_json_string_holding_a_python_literal_stays_that_string():
    """vLLM's test_double_encoded_object_param (same file) turns "{'key': 'value', 'n': 1}",
    quoted, into an object: a workaround for models trained on a buggy template. baton keeps
    the string the model quoted (a schema violation the client sees, rather than a guess that
    unquotes what the model may have meant as text)."""
    process = tool("process", {"name": STRING, "data": {"type": "object"}})
    quoted = "\"{'key': 'value', 'n': 1}\""
    text = block("process", ("name", "hello"), ("data", quoted)) + "\n"
    case = Case(name="declined", text=text, calls=(("process", {"name": "hello", "data": quoted}),))
    check(output_parser("qwen3_coder", tools=[process]), case)


@pytest.mark.parametrize(
    "content",
    [
        'x = """\n<parameter=path>\na\n</parameter>\n</function>\n"""\n',  # a fragment it opens
        'print("<tool_call>")\nprint("</tool_call>")\n',  # tags that continue no call
        "a\n</parameter>\n<parameter=path>\nb\n",  # `path` was given: it cannot come next
    ],
)
def test_tags_a_value_opens_or_that_continue_no_call_stay_in_the_value(content):
    case = Case(
        name="baton",
        text=write_file(content) + "\nDone.",
        content="\nDone.",
        calls=(("write_file", {"path": "test.py", "content": content[:-1]}),),
    )
    check(output_parser("qwen3_coder", tools=[WRITE_FILE]), case)
