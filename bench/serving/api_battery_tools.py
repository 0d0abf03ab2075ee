"""The battery's tool, reasoning and /v1/responses requests (issue 36; baton.bench.serving.api_side_by_side adds
them to the cases of bench/serving/api_battery.py)."""

from __future__ import annotations

from typing import Any

from baton.bench.serving.api_battery import MESSAGES, Case

# ---- tools, reasoning and /v1/responses (issue 36). Both servers are expected to run with
# --tool-call-parser hermes --enable-auto-tool-choice --reasoning-parser qwen3 (the shipped
# model's template writes hermes-style calls); the forced choices need structured outputs.

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add a and b",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
        },
    },
}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TOOL_HISTORY = [
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


def tool_and_reasoning_cases(model: str) -> list[Case]:
    ch, r = "/v1/chat/completions", "/v1/responses"
    tools = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 40}
    tools |= {"tools": [ADD_TOOL], **NO_THINKING}
    named = {"type": "function", "function": {"name": "add"}}
    think = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 12}
    answer = {"model": model, "temperature": 0, "max_output_tokens": 12}
    answer |= {"input": MESSAGES[0]["content"], "reasoning": {"effort": "none"}}
    return [
        # ---- tools: valid
        Case("t.auto", ch, tools, greedy=True),
        Case("t.auto.stream", ch, {**tools, "stream": True}, greedy=True),
        Case("t.none", ch, {**tools, "tool_choice": "none"}, greedy=True),
        Case("t.required", ch, {**tools, "tool_choice": "required"}, greedy=True),
        Case(
            "t.required.stream",
            ch,
            {**tools, "tool_choice": "required", "stream": True},
            greedy=True,
        ),
        Case(
            "t.required.single",
            ch,
            {**tools, "tool_choice": "required", "parallel_tool_calls": False},
            greedy=True,
        ),
        Case("t.named", ch, {**tools, "tool_choice": named}, greedy=True),
        Case("t.named.stream", ch, {**tools, "tool_choice": named, "stream": True}, greedy=True),
        Case("t.history", ch, {**tools, "messages": TOOL_HISTORY}, greedy=True),
        # ---- tools: refused
        Case("t.tools_empty", ch, {**tools, "tools": []}),
        Case(
            "t.named_unknown",
            ch,
            {**tools, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
        ),
        Case("t.choice_without_tools", ch, {**think, "tool_choice": "required"}),
        Case("t.tool_not_function", ch, {**tools, "tools": [{"type": "retrieval"}]}),
        # ---- reasoning
        Case("r.thinking", ch, think, greedy=True),
        Case("r.thinking.stream", ch, {**think, "stream": True}, greedy=True),
        Case("r.no_thinking", ch, {**think, **NO_THINKING}, greedy=True),
        Case("r.effort_none", ch, {**think, "reasoning_effort": "none"}, greedy=True),
        Case("r.hidden", ch, {**think, "include_reasoning": False}, greedy=True),
        Case(
            "r.history_reasoning_content",
            ch,
            {
                **think,
                "messages": [
                    *MESSAGES,
                    {"role": "assistant", "content": "7", "reasoning_content": "3 + 4"},
                    {"role": "user", "content": "And 2 more?"},
                ],
            },
            greedy=True,
        ),
        # ---- responses
        Case("resp.text", r, answer, greedy=True),
        Case("resp.text.stream", r, {**answer, "stream": True}, greedy=True),
        Case("resp.reasoning", r, {**answer, "reasoning": None}, greedy=True),
        Case(
            "resp.tool_turn",
            r,
            {
                **answer,
                "input": [
                    {"role": "user", "content": MESSAGES[0]["content"]},
                    {"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": "7"},
                ],
                "tools": [{"type": "function", **ADD_TOOL["function"]}],
            },
            greedy=True,
        ),
        Case(
            "resp.named_call",
            r,
            {
                **answer,
                "max_output_tokens": 40,
                "tools": [{"type": "function", **ADD_TOOL["function"]}],
                "tool_choice": {"type": "function", "name": "add"},
            },
            greedy=True,
        ),
        Case(
            "resp.json_schema",
            r,
            {
                **answer,
                "max_output_tokens": 40,
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "sum",
                        "schema": ADD_TOOL["function"]["parameters"],
                    }
                },
            },
            greedy=True,
        ),
        Case("resp.previous_response_id", r, {**answer, "previous_response_id": "resp_1"}),
        Case("resp.store", r, {**answer, "store": True}),
    ]


def tool_and_reasoning_client_calls(model: str) -> list[tuple[str, Any]]:
    tools = {"model": model, "messages": MESSAGES, "max_tokens": 40, "temperature": 0}
    tools |= {"tools": [ADD_TOOL], "extra_body": NO_THINKING}
    answer = {"model": model, "input": MESSAGES[0]["content"], "max_output_tokens": 12}
    answer |= {"temperature": 0, "reasoning": {"effort": "none"}}
    return [
        (
            "chat.tools.required",
            lambda c: c.chat.completions.create(**tools, tool_choice="required"),
        ),
        (
            "chat.tools.required.stream",
            lambda c: list(c.chat.completions.create(**tools, tool_choice="required", stream=True)),
        ),
        ("chat.reasoning", lambda c: c.chat.completions.create(**tools | {"extra_body": {}})),
        ("responses.text", lambda c: c.responses.create(**answer)),
        ("responses.stream", lambda c: list(c.responses.create(**answer, stream=True))),
    ]
