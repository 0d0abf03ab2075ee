"""chat_template_kwargs (vLLM's): variables a chat template reads, such as Nemotron's
`enable_thinking`; apply_chat_template's own arguments are refused by name."""

from __future__ import annotations

import pytest

from baton.server.errors import APIError
from baton.server.openai.protocol import ChatMessage
from baton.server.tokenizer import Tokenizer
from tests.tiny import save_tokenizer

THINKING_TEMPLATE = (
    "{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [ChatMessage(role="user", content="Tom has 3 apples.")]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("thinking-tokenizer")
    save_tokenizer(path, 320)
    tokenizer = Tokenizer(str(path))
    tokenizer.hf.chat_template = THINKING_TEMPLATE
    return tokenizer


def test_template_variables_reach_the_template(tokenizer):
    plain = tokenizer.encode_chat(MESSAGES)
    assert tokenizer.encode_chat(MESSAGES, True, {"enable_thinking": True}) == plain
    off = tokenizer.encode_chat(MESSAGES, True, {"enable_thinking": False})
    assert tokenizer.decode(off).startswith("/no_think\n")
    assert off[-len(plain) :] == plain


@pytest.mark.parametrize("reserved", ["tokenize", "conversation", "add_generation_prompt", "tools"])
def test_the_templates_own_arguments_are_refused(tokenizer, reserved):
    with pytest.raises(APIError) as caught:
        tokenizer.encode_chat(MESSAGES, True, {reserved: True})
    assert caught.value.status == 400 and caught.value.param == "chat_template_kwargs"
    assert repr(reserved) in caught.value.message


def test_reasoning_effort_none_turns_thinking_off_as_in_vllm(tokenizer):
    """OpenAI's reasoning_effort reaches the template as vLLM passes it: the variable itself,
    and enable_thinking = (effort != "none") unless chat_template_kwargs set it."""
    from baton.server.openai.protocol import ChatCompletionRequest

    def variables(**fields):
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **fields)
        return request.template_variables()

    off = tokenizer.encode_chat(MESSAGES, True, variables(reasoning_effort="none"))
    assert tokenizer.decode(off).startswith("/no_think\n")
    assert variables(reasoning_effort="low") == {"reasoning_effort": "low", "enable_thinking": True}
    kept = variables(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert kept["enable_thinking"] is True
    assert variables() == {}
