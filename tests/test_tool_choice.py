"""What tools and tool_choice make of a chat request without a model: the model-free 400s, the
JSON schemas of forced calls (checked with jsonschema against outputs that must pass or fail),
the grammar's place after the reasoning, the history as the template receives it, and the
Responses API's requests as the chat requests they amount to."""

from __future__ import annotations

import json

import jsonschema
import pytest

from baton.engine.core.sampling_params import SamplingParams, StructuredOutputs
from baton.engine.structured_output import check_structured_outputs
from baton.server.errors import APIError
from baton.server.openai.protocol import ChatCompletionRequest
from baton.server.openai.responses.protocol import ResponsesRequest, to_chat_request
from baton.server.openai.tool_choice import check_tools, plan_output, required_schema
from baton.server.openai.validation import check_generation
from baton.server.parsers.output import ParserSettings
from baton.server.parsers.tools import make_tool_parser
from baton.server.tokenizer import conversation_for_template

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"$ref": "#/$defs/number"}},
            "required": ["a", "b"],
            "$defs": {"number": {"type": "integer"}},
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
HERMES = ParserSettings(
    tool_call_parser="hermes", enable_auto_tool_choice=True, reasoning_parser=None
)
QWEN3 = ParserSettings(
    tool_call_parser=None, enable_auto_tool_choice=False, reasoning_parser="qwen3"
)
NONE = ParserSettings(tool_call_parser=None, enable_auto_tool_choice=False, reasoning_parser=None)


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "2 + 3?"}], **fields)


def refusal(call) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400
    return caught.value


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tools": []}, "tools", "must not be an empty array"),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
            "'mul', which is not in tools (add)",
        ),
    ],
)
def test_tool_rules_without_a_model_are_400s_naming_the_field(fields, param, words):
    error = refusal(lambda: check_tools(chat(**fields)))
    assert error.param == param and words in error.message


def test_auto_without_a_parser_is_refused_with_vllms_message():
    error = refusal(lambda: plan_output(chat(tools=[ADD]), NONE, "", {}))
    assert "--enable-auto-tool-choice and --tool-call-parser" in error.message
    flagless = ParserSettings(
        tool_call_parser="hermes", enable_auto_tool_choice=False, reasoning_parser=None
    )
    unparsed = plan_output(chat(tools=[ADD]), flagless, "", {})
    assert not unparsed.parses, "a parser without --enable-auto-tool-choice leaves text as it is"


def test_required_schema_takes_calls_of_the_given_tools_only():
    schema = required_schema(chat(tools=[ADD, NOW]).tools, None)
    good = [{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "mul", "parameters": {}}],
        [{"name": "add", "parameters": {"a": 1}}],
        [{"name": "add", "parameters": {"a": 1, "b": "2"}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(chat(tools=[ADD, NOW]).tools, False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, single)


def test_forced_calls_ask_for_a_json_grammar_after_the_reasoning():
    named = {"type": "function", "function": {"name": "add"}}
    plan = plan_output(chat(tools=[ADD], tool_choice=named), NONE, "", {})
    structured = plan.sampling(SamplingParams(), [9, 9]).structured_outputs
    assert structured.kind == "json" and structured.after_token_ids == ()
    assert json.loads(structured.spec) == ADD["function"]["parameters"]
    thinking = plan_output(chat(tools=[ADD], tool_choice="required"), QWEN3, "<think>\n", {})
    structured = thinking.sampling(SamplingParams(), [7, 8]).structured_outputs
    assert structured.after_token_ids == (7, 8)
    closed = plan_output(chat(tools=[ADD], tool_choice="required"), QWEN3, "<think></think>", {})
    assert closed.sampling(SamplingParams(), [7, 8]).structured_outputs.after_token_ids == ()
    auto = plan_output(chat(tools=[ADD]), HERMES, "", {})
    assert auto.sampling(SamplingParams(), []).structured_outputs is None


def test_a_requested_grammar_waits_for_the_reasoning_and_excludes_forced_calls():
    given = StructuredOutputs(kind="regex", spec="[0-9]+", after_token_ids=())
    params = SamplingParams(structured_outputs=given)
    thinking = plan_output(chat(), QWEN3, "<think>\n", {})
    moved = thinking.sampling(params, [7, 8]).structured_outputs
    assert moved == StructuredOutputs(kind="regex", spec="[0-9]+", after_token_ids=(7, 8))
    forced = plan_output(chat(tools=[ADD], tool_choice="required"), NONE, "", {})
    assert refusal(lambda: forced.sampling(params, [])).param == "tool_choice"


def test_forced_calls_are_read_from_the_bare_json_without_any_parser_flag():
    plan = plan_output(chat(tools=[ADD], tool_choice="required"), NONE, "", {})
    assert plan.parses
    parsed = plan.parser().parse('[{"name": "add", "parameters": {"a": 1, "b": 2}}]', "stop")
    assert [(call.name, call.arguments) for call in parsed.calls] == [("add", '{"a": 1, "b": 2}')]
    assert not plan_output(chat(), NONE, "", {}).parses


def test_finish_reason_is_tool_calls_except_for_a_named_function():
    required = plan_output(chat(tools=[ADD], tool_choice="required"), NONE, "", {})
    assert required.finish_reason("stop", made_calls=True) == "tool_calls"
    assert required.finish_reason("length", made_calls=True) == "length"
    named = {"type": "function", "function": {"name": "add"}}
    assert (
        plan_output(chat(tools=[ADD], tool_choice=named), NONE, "", {}).finish_reason(
            "stop", made_calls=True
        )
        == "stop"
    )


def test_history_reaches_the_template_as_vllm_passes_it():
    request = ChatCompletionRequest(
        messages=[
            {"role": "user", "content": "2 + 3?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "add them",
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2}'},
                    },
                    {
                        "id": "c2",
                        "type": "function",
                        "function": {"name": "add", "arguments": "not json"},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ]
    )
    _, assistant, tool = conversation_for_template(request.messages, "")
    assert assistant["content"] == "" and assistant["reasoning"] == "add them"
    assert assistant["reasoning_content"] == "add them"
    assert [call["function"]["arguments"] for call in assistant["tool_calls"]] == [{"a": 2}, {}]
    assert tool == {"role": "tool", "content": "5", "tool_call_id": "c1"}


def test_a_responses_request_is_the_chat_request_it_amounts_to():
    request = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "2 + 3?"}]},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "add"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "5"},
            ],
            "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "add"},
            "max_output_tokens": 9,
            "reasoning": {"effort": "none"},
        }
    )
    converted = to_chat_request(request)
    check_generation(converted)
    roles = [message.role for message in converted.messages]
    assert roles == ["system", "user", "assistant", "tool"]
    assert converted.messages[2].reasoning == "add"
    assert converted.messages[2].tool_calls[0].id == "c1"
    assert converted.tool_choice.function.name == "add" and converted.max_tokens == 9
    assert converted.template_variables()["enable_thinking"] is False


@pytest.mark.parametrize(
    "fields", [{"previous_response_id": "resp_1"}, {"store": True}, {"background": True}]
)
def test_responses_that_need_stored_state_are_refused_by_name(fields):
    request = ResponsesRequest.model_validate({"input": "hi", **fields})
    error = refusal(lambda: to_chat_request(request))
    assert error.param == next(iter(fields)) and "keeps no responses" in error.message


def test_tools_with_odd_schemas_are_a_400_or_read_without_types_never_a_crash():
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}
    spec = json.dumps(required_schema(chat(tools=[odd]).tools, None))
    with pytest.raises(ValueError, match=r"at /\$defs/tool_0/type: invalid schema: 5 is not valid"):
        check_structured_outputs(StructuredOutputs(kind="json", spec=spec, after_token_ids=()))
    shapes = [{"properties": [1]}, {"properties": {"x": True}}, {"properties": {"x": {"type": 5}}}]
    for parameters in shapes:
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        parser = make_tool_parser("qwen3_coder", [tool])
        text = "<tool_call><function=f><parameter=x>3</parameter></function></tool_call>"
        (call,) = parser.parse(text, "stop").calls
        assert call.arguments == '{"x": "3"}'


def test_chat_template_flag_takes_a_file_or_the_template_itself(tmp_path):
    from baton.server.args import load_chat_template

    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(template)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="no such file"):
        load_chat_template(str(tmp_path / "missing.jinja"))


def test_a_responses_request_refused_on_the_chat_side_names_its_own_field():
    from baton.server.openai.responses.protocol import named_as_responses
    from baton.server.openai.validation import parse_generation

    with pytest.raises(APIError) as caught:
        parse_generation("/v1/responses", {"input": []})
    assert caught.value.param == "input" and caught.value.message.startswith("input")
    with pytest.raises(APIError) as caught, named_as_responses():
        raise APIError.bad_request("max_tokens (5000) exceeds max-model-len (2048)")
    assert caught.value.param == "max_output_tokens"
    assert caught.value.message == "max_output_tokens (5000) exceeds max-model-len (2048)"
