"""The server's tokenizer: prompts and chat templates to ids, ids to text and to exact bytes.

Generated text is detokenized incrementally by EngineClient.generate (engine/core/detokenizer.py)
from the engine's token ids; this class decodes single tokens for logprobs, where OpenAI wants
each token's string and raw bytes.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from baton.engine.runtime.cpu_allocator import release_freed_memory
from baton.server.errors import APIError
from baton.server.openai.prompt_bound import TRIM_AFTER_CHARS, encode_within, tokenizer_bound
from baton.server.openai.protocol import ChatMessage


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable char standing for each byte."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length",
        "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip

# What AutoTokenizer needs at least one of (engine/core/engine.py's offline LLM checks the same).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def load_tokenizer(directory: str, flag: str, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer in `directory` (given as `flag`: --model or --tokenizer), or RuntimeError
    saying what is missing or broken there, before any request needs it."""
    if not any(Path(directory, name).is_file() for name in TOKENIZER_FILES):
        hint = " (pass --tokenizer DIR for one kept elsewhere)" if flag == "--model" else ""
        raise RuntimeError(
            f"{flag} {directory}: no tokenizer there (neither {' nor '.join(TOKENIZER_FILES)})"
            + hint
        )
    try:
        return Tokenizer(directory, chat_template)
    except Exception as error:  # transformers and tokenizers raise many kinds for broken files
        raise RuntimeError(f"{flag} {directory}: cannot load its tokenizer: {error}") from error


def _message_for_template(message: ChatMessage) -> dict[str, Any]:
    """One message as vLLM hands it to a template: text parts joined (a null content is ""),
    an assistant's tool calls with their arguments as a mapping (JSON text that is not an
    object becomes {}, so one bad turn cannot break every later request of the conversation),
    a tool result's tool_call_id, and an assistant's reasoning under both names templates read."""
    entry: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        entry["name"] = message.name
    if message.role == "assistant" and message.tool_calls:
        entry["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function)},
            }
            for call in message.tool_calls
        ]
    if message.role == "tool" and message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if message.role == "assistant" and reasoning is not None:
        entry["reasoning"] = entry["reasoning_content"] = reasoning
    return entry


def _arguments(function) -> dict[str, Any]:
    arguments = function.arguments
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):  # protocol.JsonText refused valid JSON too deep
            arguments = None
    return arguments if isinstance(arguments, dict) else {}


def conversation_for_template(messages: list[ChatMessage], template: str) -> list[dict]:
    """The messages as the chat template gets them, as vLLM passes them (_message_for_template),
    and for a template that never names the "developer" role, developer
    messages turned into system ones and every system message merged (blank line between)
    into one first message, since templates that know only "system" often want it first."""
    conversation = [_message_for_template(message) for message in messages]
    knows_developer = "'developer'" in template or '"developer"' in template
    if knows_developer or all(message["role"] != "developer" for message in conversation):
        return conversation
    for message in conversation:
        if message["role"] == "developer":
            message["role"] = "system"
    system = [message for message in conversation if message["role"] == "system"]
    if len(system) == 1 and conversation[0] is system[0]:
        return conversation
    merged = "\n\n".join(message["content"] for message in system if message["content"])
    rest = [message for message in conversation if message["role"] != "system"]
    return [{"role": "system", "content": merged}, *rest]


class Tokenizer:
    def __init__(self, model_dir: str, chat_template: str | None = None) -> None:
        self.hf = AutoTokenizer.from_pretrained(model_dir)
        if chat_template is not None:  # --chat-template, over the model's own
            self.hf.chat_template = chat_template
        decoder = getattr(getattr(self.hf, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}
        self.token_bytes = lru_cache(maxsize=None)(self._token_bytes)
        # the most bytes of text one token covers; None: this tokenizer can shrink a text
        self.max_token_bytes = tokenizer_bound(self.hf)

    def encode(
        self,
        text: str,
        add_special_tokens: bool = True,
        limit: int | None = None,
        param: str = "prompt",
    ) -> list[int]:
        """The text's token ids. `limit`: the most tokens the prompt may have; a text proved
        longer is refused (APIError 400 naming `param`) before it is tokenized whole
        (server/openai/prompt_bound.py). A long text's tokenization gives its memory back after."""
        try:
            if limit is None:
                return list(self.hf.encode(text, add_special_tokens=add_special_tokens))
            return encode_within(
                text,
                lambda part: list(self.hf.encode(part, add_special_tokens=add_special_tokens)),
                self.max_token_bytes,
                limit,
                param,
            )
        finally:
            if len(text) >= TRIM_AFTER_CHARS:
                release_freed_memory()

    def encode_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        tools: list[dict[str, Any]] | None = None,
        limit: int | None = None,
    ) -> list[int]:
        """render_chat, then tokenize (the template holds any BOS). `limit`: as encode's, for
        the rendered text."""
        text = self.render_chat(
            messages, add_generation_prompt, template_kwargs, continue_final_message, tools
        )
        return self.encode(text, add_special_tokens, limit, "messages")

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The chat template's text. `template_kwargs` are the request's chat_template_kwargs:
        variables the template reads (vLLM's; Nemotron's templates take `enable_thinking`).
        `continue_final_message` ends the prompt inside the last message (assistant prefill),
        as vLLM's field does. `tools`: the request's tools, as the template's `tools`."""
        conversation = conversation_for_template(messages, self.hf.chat_template or "")
        variables = dict(template_kwargs or {})
        for reserved in RESERVED_TEMPLATE_KWARGS.intersection(variables):
            raise APIError.bad_request(
                f"chat_template_kwargs: {reserved!r} is set by the server, not by a request",
                "chat_template_kwargs",
            )
        try:
            text = self.hf.apply_chat_template(
                conversation,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                tools=tools,
                **variables,
            )
        except Exception as error:  # jinja raises its own errors for conversations it rejects
            raise APIError.bad_request(
                f"messages: the chat template failed: {error}", "messages"
            ) from error
        return text

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens(token_id)
        if self._byte_level and all(char in self._alphabet for char in piece):
            return bytes(self._alphabet[char] for char in piece)
        return self.hf.decode([token_id]).encode()

    def token_text(self, token_id: int) -> str:
        """The token's text; a token that is only part of a UTF-8 character shows as U+FFFD."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")
