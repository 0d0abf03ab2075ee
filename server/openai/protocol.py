"""OpenAI request bodies (pydantic). Unknown fields are ignored; NaN and infinities refused.

Types are strict, as OpenAI's API has them: `max_tokens: "16"` or `true` is a 400, not a 16 or
a 1 (vLLM coerces both); bools are not ints; an int is accepted where a float is expected. Every
string is checked to be encodable text (a lone UTF-16 surrogate such as "\ud800" parses from
JSON but cannot reach the tokenizer, msgpack or a UTF-8 response), so it is refused here with the
field's name instead of failing later as a 500.

Range checks that SamplingParams already makes are left to it (one place names the limit);
the bounds here are the ones only the HTTP layer needs: `n` fan-out and a 64-bit seed.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from baton.disagg.address_token import TOKEN_CHARS

MAX_N = 128  # choices per request; each one is an engine request
# OpenAI bodies nest a few levels; 100k-deep JSON must not reach a parser. Holds for the body and
# for JSON text inside it (tool-call arguments), which the history's rendering parses.
MAX_JSON_DEPTH = 64
MAX_SEED = 2**63 - 1 - MAX_N  # seed + choice index must stay a signed 64-bit integer


def _encodable(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"not valid Unicode text: lone surrogate {text[error.start]!r} at character {error.start}"
        ) from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


def nests_deeper_than(value: Any, levels: int) -> bool:
    """Whether parsed JSON holds containers more than `levels` deep (the outermost is level 1),
    walked level by level: a recursive walk would overflow on the input it is meant to refuse."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(levels):
        level = [
            child
            for container in level
            for child in (container.values() if isinstance(container, dict) else container)
            if isinstance(child, (dict, list))
        ]
    return bool(level)


def _shallow_json(text: str) -> str:
    """JSON text nested at most MAX_JSON_DEPTH levels (parsing it deeper overflows the stack
    where the history is rendered); text that is not JSON passes as it is."""
    try:
        deep = nests_deeper_than(json.loads(text), MAX_JSON_DEPTH)
    except RecursionError:
        deep = True
    except ValueError:
        return text
    if deep:
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return text


JsonText = Annotated[Text, AfterValidator(_shallow_json)]  # JSON carried as a string


def unencodable_text(body: dict) -> tuple[str, str] | None:
    """(path, reason) of the first string in a parsed JSON body, key or value, that is not
    encodable text, wherever it sits (a field baton ignores too: the router forwards every
    field, and its UTF-8 request to a worker could not carry it); None when there is none."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not value.isascii():
            try:
                _encodable(value)
            except ValueError as error:
                return path or "request body", str(error)
        elif isinstance(value, (dict, list)):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in items:
                where = f"{path}.{key}" if path else str(key)
                if isinstance(key, str) and not key.isascii():
                    stack.append((where, key))
                stack.append((where, child))
    return None


ChatRole = Literal["system", "developer", "user", "assistant", "tool"]  # OpenAI's set


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class DisaggField(OpenAIModel):
    """Set by `baton router` on requests it forwards to disaggregated workers."""

    room: Text = Field(min_length=1, max_length=128)
    prefill_addr: Text | None = None
    # The prefill worker's HMAC of prefill_addr (its /disagg/info transfer_addr_token): a decode
    # worker with a --disagg-secret dials no address without one (disagg/address_token.py).
    prefill_addr_token: Text | None = Field(None, max_length=TOKEN_CHARS)


class GenerationFields(OpenAIModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Text | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # vLLM's
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    logit_bias: dict[Text, float] | None = None
    baton_disagg: DisaggField | None = None
    # structured outputs: read, and refused with a message naming the field when malformed, by
    # server/openai/structured.py
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # OpenAI's and vLLM's fields that change what is generated and that baton does not do:
    # parsed so that check_generation refuses them by name (unknown fields are ignored).
    functions: Any = None
    function_call: Any = None
    prompt_logprobs: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    logits_processors: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    logprob_token_ids: Any = None
    prompt_embeds: Any = None
    return_tokens_as_token_ids: Any = None
    return_token_ids: bool | None = None  # vLLM's: prompt and output token ids in the answer
    return_token_offsets: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    vllm_xargs: Any = None
    # vLLM's: keep the prompt's last (truncation_side "left") or first ("right") k tokens;
    # -1: as many as the context holds with one token to generate
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM: include_usage and continuous_usage_stats both on)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(GenerationFields):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. around the prompt
    best_of: Any = None
    suffix: Any = None
    tools: Any = None  # chat's; parsed to be refused by name
    tool_choice: Any = None


class TextContentPart(OpenAIModel):
    """A message's content part. The server takes text only: a part of any other type (an
    image, audio, a video, a file, as vision-language checkpoints would take) is refused by
    its type, not by a generic shape error."""

    type: Text
    text: Text | None = None

    @model_validator(mode="after")
    def text_only(self) -> TextContentPart:
        if self.type != "text":
            raise ValueError(
                f"content parts of type {self.type!r} are not supported: this server takes "
                "text only (no image, audio, video or file input)"
            )
        if self.text is None:
            raise ValueError("a text content part needs a 'text' field")
        return self


class FunctionDefinition(OpenAIModel):
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[Text, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    def for_template(self) -> dict[str, Any]:
        """As vLLM hands a tool to the chat template: `strict` only when it was given."""
        return self.model_dump(exclude={"strict"} if self.strict is None else set())


class ChatTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: Text = Field(min_length=1)


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class ToolCallFunction(OpenAIModel):
    name: Text
    arguments: JsonText | dict[Text, Any] | None = None  # JSON text, as OpenAI sends it back


class MessageToolCall(OpenAIModel):
    """A tool call of an earlier assistant turn, as the client sends the history back."""

    id: Text | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    role: ChatRole
    content: Text | list[TextContentPart] | None = None
    name: Text | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: Text | None = None  # tool
    # An assistant turn's thinking (vLLM's name, and the one Qwen templates read)
    reasoning: Text | None = None
    reasoning_content: Text | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # vLLM joins text parts so


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's assistant prefill: the prompt ends inside it
    chat_template_kwargs: dict[Text, Any] | None = None  # vLLM's: e.g. {"enable_thinking": false}
    add_special_tokens: bool = False  # vLLM's: the template already holds them
    # OpenAI's; as vLLM, given to the template with enable_thinking = (effort != "none")
    reasoning_effort: Text | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    include_reasoning: bool = True  # vLLM's: false leaves the reasoning out of the answer
    # vLLM's chat fields that change the output, parsed to be refused by name
    echo: Any = None
    chat_template: Any = None
    documents: Any = None
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None

    def template_variables(self) -> dict[str, Any]:
        """chat_template_kwargs, plus reasoning_effort as vLLM passes it to templates."""
        variables = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables["reasoning_effort"] = self.reasoning_effort
            variables.setdefault("enable_thinking", self.reasoning_effort != "none")
        return variables


class TokenizeRequest(OpenAIModel):
    """Either `prompt` (tokenized as /v1/completions would) or `messages` (chat template)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[Text, Any] | None = None
    tools: list[ChatTool] | None = None  # rendered by the chat template, as chat does
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIModel):
    model: Text | None = None
    tokens: list[int]


class SGLangSamplingParams(OpenAIModel):
    """SGLang's `sampling_params` of POST /generate, with its defaults (max_new_tokens 128)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Text | list[Text] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=MAX_N)
    sampling_seed: int | None = Field(None, ge=0, le=MAX_SEED)
    logit_bias: dict[Text, float] | None = None
    # constrained decoding (server/openai/validation.py maps them onto vLLM's structured_outputs)
    json_schema: Any = None
    regex: Any = None
    ebnf: Any = None
    structural_tag: Any = None


class GenerateRequest(OpenAIModel):
    """SGLang's native POST /generate: `text` or `input_ids` (one prompt or a batch)."""

    text: Text | list[Text] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    # one set for every prompt, or (SGLang's batch form) one per prompt, here all the same
    sampling_params: SGLangSamplingParams | list[SGLangSamplingParams] | None = None
    stream: bool = False
    rid: Any = None  # SGLang's request id; baton mints its own
    # logprobs of the output, and of the prompt from logprob_start_len on (-1: none)
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    # parsed to be refused by name unless neutral
    lora_path: Any = None
    image_data: Any = None
    baton_disagg: DisaggField | None = None
