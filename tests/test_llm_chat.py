"""The offline LLM's chat: the same prompt as the server renders for the same messages and
tools (shipped model and template), and the text generate gives for it."""

from __future__ import annotations

from baton.engine.core.llm import LLM
from baton.engine.core.sampling_params import SamplingParams
from baton.server.openai.protocol import ChatCompletionRequest
from baton.server.tokenizer import Tokenizer
from baton.server.up import DEFAULT_MODEL
from tests.tool_requests import MESSAGES, TOOLS


def test_chat_renders_tools_as_the_server_does_and_generates():
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "add", "arguments": {"a": 3}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "7"},
    ]
    tools = TOOLS[:1]  # given whole (description, parameters), as the server hands tools on
    request = ChatCompletionRequest(messages=history, tools=tools)
    served = Tokenizer(DEFAULT_MODEL).encode_chat(
        request.messages,
        tools=[
            {"type": "function", "function": tool.function.for_template()} for tool in request.tools
        ],
    )
    greedy = SamplingParams(max_tokens=8, temperature=0)
    with LLM(DEFAULT_MODEL, max_num_batched_tokens=1024) as llm:
        (output,) = llm.chat(history, greedy, tools=tools)
        (reference,) = llm.generate([served], greedy)
    assert output.prompt_token_ids == served
    assert output.text == reference.text and output.text
