"""Tools and reasoning through the official `openai` client against one real `baton serve` of
the shipped model, started as an agent deployment would be: --tool-call-parser hermes
--enable-auto-tool-choice --reasoning-parser qwen3."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from baton.server.up import DEFAULT_MODEL
from tests.server_process import start_server
from tests.tool_requests import (
    ADD_PARAMETERS,
    GREEDY,
    MESSAGES,
    NO_THINKING,
    QUESTION,
    SCHEMAS,
    TOOLS,
    check_forced_calls,
    needs_grammar,
    streamed_message,
)

MODEL = DEFAULT_MODEL
FLAGS = ("--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--reasoning-parser", "qwen3")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = start_server(MODEL, tmp_path_factory.mktemp("tools-serve"), *FLAGS)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_a_tool_round_trip_renders_through_the_shipped_template(server, client):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    ]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=history,
        tools=TOOLS,
        extra_body={"return_token_ids": True, **NO_THINKING},
        **GREEDY,
    )
    prompt = AutoTokenizer.from_pretrained(MODEL).decode(answer.prompt_token_ids)
    assert prompt.startswith('Tools:\n{"name": "add", "description": "Add a and b", "parameters"')
    assert f"Question: {QUESTION}\nAnswer: " in prompt
    assert '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>\n\n' in prompt
    assert prompt.endswith("Tool result: 7\nAnswer:")
    assert answer.choices[0].message.content
    tokenized = server.http().post(
        "/tokenize", json={"messages": history, "tools": TOOLS, **NO_THINKING}
    )
    assert tokenized.json()["tokens"] == answer.prompt_token_ids


def test_auto_answers_with_text_when_the_model_calls_no_tool(client):
    request = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, extra_body=NO_THINKING, **GREEDY)
    auto = client.chat.completions.create(**request).choices[0]
    plain = client.chat.completions.create(**request, tool_choice="none").choices[0]
    assert auto.message.content == plain.message.content and auto.message.content
    assert auto.message.tool_calls is None and auto.finish_reason in ("stop", "length")
    streamed, finish_reason = streamed_message(client, **request)
    assert streamed["content"] == auto.message.content and streamed["tool_calls"] == []
    assert finish_reason == auto.finish_reason


def test_thinking_goes_to_reasoning_and_enable_thinking_false_to_content(client):
    """The shipped template opens no thinking block, so qwen3 reads the whole answer as
    reasoning (cut by max_tokens before any </think>); with enable_thinking false, the same
    greedy text is the content."""
    request = dict(model=MODEL, messages=MESSAGES, **GREEDY)
    answer = client.chat.completions.create(**request, extra_body=NO_THINKING).choices[0]
    thinking = client.chat.completions.create(**request).choices[0]
    assert thinking.message.content is None
    assert thinking.message.reasoning == answer.message.content and answer.message.content
    streamed, _ = streamed_message(client, **request)
    assert streamed["reasoning"] == thinking.message.reasoning and streamed["content"] == ""
    hidden = client.chat.completions.create(**request, extra_body={"include_reasoning": False})
    assert getattr(hidden.choices[0].message, "reasoning", None) is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": []}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, **fields, **GREEDY)
    assert caught.value.body["param"] == param


@needs_grammar
def test_required_and_named_choices_return_calls_that_validate(client):
    check_forced_calls(client, MODEL, NO_THINKING)


# The Responses API (what the OpenAI Agents SDK calls), on the same server.

FUNCTION_TOOLS = [
    {"type": "function", "name": tool["function"]["name"], "strict": True, **tool["function"]}
    for tool in TOOLS
]
BRIEF = {"max_output_tokens": 8, "temperature": 0}
ANSWER_ONLY = {"reasoning": {"effort": "none"}}  # enable_thinking false, as vLLM passes it


def test_a_text_response_is_the_chat_answer_to_the_same_messages(client):
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input=QUESTION, **ANSWER_ONLY, **BRIEF
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, *MESSAGES],
        max_tokens=8,
        temperature=0,
        reasoning_effort="none",
    )
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"


def test_a_streamed_response_sends_openais_events_in_order(client):
    with client.responses.stream(model=MODEL, input=QUESTION, **ANSWER_ONLY, **BRIEF) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == final.output_text
    whole = client.responses.create(model=MODEL, input=QUESTION, **ANSWER_ONLY, **BRIEF)
    assert whole.output_text == text


def test_thinking_comes_back_as_a_reasoning_item(client):
    response = client.responses.create(model=MODEL, input=QUESTION, **BRIEF)
    answer = client.responses.create(model=MODEL, input=QUESTION, **ANSWER_ONLY, **BRIEF)
    (item,) = response.output
    assert item.type == "reasoning" and item.content[0].text == answer.output_text


def test_an_agent_turn_with_a_tool_result_renders_like_the_chat_history(client):
    """The items the Agents SDK sends back after running a tool: the call and its output."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "add",
            "arguments": '{"a": 3, "b": 4}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "7"},
    ]
    response = client.responses.create(
        model=MODEL, input=items, tools=FUNCTION_TOOLS, tool_choice="auto", **ANSWER_ONLY, **BRIEF
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            *MESSAGES,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "7"},
        ],
        tools=[
            {"type": "function", "function": {**tool["function"], "strict": True}} for tool in TOOLS
        ],
        max_tokens=8,
        temperature=0,
        reasoning_effort="none",
    )
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


@pytest.mark.parametrize(("field", "value"), [("previous_response_id", "resp_1"), ("store", True)])
def test_responses_are_stateless_and_say_so(client, field, value):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=QUESTION, **{field: value}, **BRIEF)
    assert caught.value.body["param"] == field


@needs_grammar
def test_an_agent_gets_a_valid_tool_call_and_a_json_schema_answer(client):
    call = client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=FUNCTION_TOOLS,
        tool_choice={"type": "function", "name": "add"},
        max_output_tokens=60,
        temperature=0,
        **ANSWER_ONLY,
    )
    (item,) = call.output
    assert item.type == "function_call" and item.name == "add" and item.call_id
    jsonschema.validate(json.loads(item.arguments), SCHEMAS["add"])
    answer = client.responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "sum", "schema": ADD_PARAMETERS}},
        max_output_tokens=60,
        temperature=0,
        **ANSWER_ONLY,
    )
    jsonschema.validate(json.loads(answer.output_text), ADD_PARAMETERS)
