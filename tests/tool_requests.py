"""Requests and checks shared by the tool and reasoning tests against live servers (serve and
up): tools on the shipped model, streamed answers rebuilt from their deltas, and the forced
calls that need the structured-output engine."""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import pytest

ADD_PARAMETERS = {
    "type": "object",
    # bounded, so that even the tiny model's calls end within max_tokens
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "add", "description": "Add a and b", "parameters": ADD_PARAMETERS},
    },
    {
        "type": "function",
        "function": {
            "name": "shout",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string", "maxLength": 12}},
                "required": ["text"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = "Tom has 3 apples and buys 4 more. How many apples does he have?"
MESSAGES = [{"role": "user", "content": QUESTION}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0, "max_tokens": 8}

# Forced calls are correct only under the grammar, which the structured-output engine
# (engine/structured_output, branch structured-36) enforces; until it is merged these tests are
# skipped.
needs_grammar = pytest.mark.skipif(
    importlib.util.find_spec("baton.engine.structured_output") is None,
    reason="needs the structured-output engine (engine/structured_output, branch structured-36)",
)


def streamed_message(client, **request) -> tuple[dict, str | None]:
    """The message rebuilt from a streamed answer's deltas, and its finish_reason."""
    message = {"content": "", "reasoning": "", "tool_calls": {}}
    finish_reason = None
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        delta = choice.delta.model_dump(exclude_none=True)
        message["content"] += delta.get("content", "")
        message["reasoning"] += delta.get("reasoning", "")
        for call in delta.get("tool_calls", []):
            entry = message["tool_calls"].setdefault(call["index"], {"arguments": ""})
            if "id" in call:
                assert "name" in call["function"], "a call opens with its name"
                entry.update(id=call["id"], name=call["function"]["name"])
            entry["arguments"] += call["function"].get("arguments", "")
        finish_reason = choice.finish_reason or finish_reason
    message["tool_calls"] = [
        message["tool_calls"][index] for index in sorted(message["tool_calls"])
    ]
    return message, finish_reason


def unstreamed_calls(choice) -> list[dict]:
    return [
        {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
        for call in choice.message.tool_calls or []
    ]


def assert_valid_calls(calls: list[dict], names: set[str]) -> None:
    """Every call names a given tool and its arguments validate against that tool's schema."""
    assert calls, "a forced choice returns at least one call"
    for call in calls:
        assert call["name"] in names and call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def check_forced_calls(client, model: str, extra: dict) -> None:
    """tool_choice required and a named function, streamed and not: calls that validate."""
    named = {"type": "function", "function": {"name": "shout"}}
    for choice, names, finish in (
        ("required", set(SCHEMAS), "tool_calls"),
        (named, {"shout"}, "stop"),
    ):
        request = dict(
            model=model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            extra_body=extra,
        )
        request.update(temperature=0, max_tokens=120)
        answer = client.chat.completions.create(**request).choices[0]
        assert answer.finish_reason == finish, answer
        assert_valid_calls(unstreamed_calls(answer), names)
        streamed, streamed_finish = streamed_message(client, **request)
        assert streamed_finish == finish
        assert_valid_calls(streamed["tool_calls"], names)
        assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [
            (c["name"], c["arguments"]) for c in unstreamed_calls(answer)
        ]
