"""The chat flags through `baton up`: both workers get --tool-call-parser, --enable-auto-tool-choice,
--reasoning-parser and --chat-template, and the router passes tools, tool_choice, reasoning
fields and /v1/responses through to the pair (official `openai` client, shipped model)."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from baton.server.up import DEFAULT_MODEL
from tests.server_process import Stack, children_of
from tests.tool_requests import (
    GREEDY,
    MESSAGES,
    NO_THINKING,
    QUESTION,
    TOOLS,
    check_forced_calls,
    needs_grammar,
    streamed_message,
)

MODEL = DEFAULT_MODEL
TEMPLATE = Path(DEFAULT_MODEL, "tokenizer_config.json")  # only read: the flag must reach workers


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import json

    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(json.loads(TEMPLATE.read_text())["chat_template"])
    flags = ["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]
    flags += ["--reasoning-parser", "qwen3", "--chat-template", str(template)]
    stack = Stack(Path(MODEL), tmp_path_factory.mktemp("tools-up") / "up.log", *flags)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="none", max_retries=0
    )


def test_both_workers_get_the_chat_flags(stack):
    for pid in children_of(stack.process.pid):
        command = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if "--disaggregation-mode" in command:
            for flag in ("--tool-call-parser", "--reasoning-parser", "--chat-template"):
                assert flag in command
            assert "--enable-auto-tool-choice" in command


def test_tools_and_reasoning_pass_through_the_router(client):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "7"},
    ]
    request = dict(model=MODEL, messages=history, tools=TOOLS, **GREEDY)
    thinking = client.chat.completions.create(**request).choices[0]
    answer = client.chat.completions.create(**request, extra_body=NO_THINKING).choices[0]
    assert thinking.message.content is None
    assert thinking.message.reasoning == answer.message.content and answer.message.content
    streamed, finish_reason = streamed_message(client, **request, extra_body=NO_THINKING)
    assert streamed["content"] == answer.message.content
    assert finish_reason == answer.finish_reason


def test_responses_pass_through_the_router(client):
    response = client.responses.create(
        model=MODEL, input=QUESTION, reasoning={"effort": "none"}, max_output_tokens=8
    )
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, reasoning_effort="none", max_tokens=8, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=QUESTION, store=True)
    assert caught.value.body["param"] == "store"


@needs_grammar
def test_forced_calls_validate_through_the_pair(client):
    check_forced_calls(client, MODEL, NO_THINKING)
