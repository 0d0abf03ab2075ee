"""POST /v1/responses bodies (OpenAI's Responses API, what the Agents SDK sends) and the chat
request each one amounts to.

    instructions          -> a first system message
    input (text)          -> a user message
    message items         -> messages (input_text / output_text parts joined)
    reasoning item        -> the `reasoning` of the next assistant message
    function_call items   -> one assistant message with those tool_calls (content null)
    function_call_output  -> a tool message
    tools, tool_choice    -> chat's function tools and tool_choice
    text.format           -> a grammar (json_schema, json_object), applied by responses.py
    reasoning.effort      -> reasoning_effort

baton keeps no state between requests: `previous_response_id`, `store: true` and the other
fields that need stored state (conversation, background, prompt) are a 400 naming them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError

from baton.server.errors import APIError, describe_validation_errors
from baton.server.openai.protocol import (
    ChatCompletionRequest,
    DisaggField,
    JsonText,
    OpenAIModel,
    Text,
)


class InputText(OpenAIModel):
    type: Literal["input_text", "output_text"]
    text: Text


class MessageItem(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)


class FunctionCallItem(OpenAIModel):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: JsonText


class FunctionCallOutputItem(OpenAIModel):
    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputText]


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text", "summary_text"]
    text: Text


class ReasoningItem(OpenAIModel):
    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None

    def text(self) -> str:
        return "\n".join(part.text for part in (self.content or self.summary))


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: Text


class TextFormat(OpenAIModel):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_schema", "json_object"]
    name: Text | None = None
    json_schema: dict[Text, Any] | None = Field(None, alias="schema")
    description: Text | None = None
    strict: bool | None = None


class TextOptions(OpenAIModel):
    format: TextFormat | None = None


class ReasoningOptions(OpenAIModel):
    effort: Text | None = None
    summary: Text | None = None


class ResponsesRequest(OpenAIModel):
    model: Text | None = None
    input: Text | list[InputItem]
    instructions: Text | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stream: bool = False
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    prompt: Any = None
    baton_disagg: DisaggField | None = None


# Fields that need a store of past responses, which baton (stateless) does not keep: each with
# the values that ask for none.
STATEFUL_FIELDS: dict[str, tuple[Any, ...]] = {
    "previous_response_id": (None,),
    "store": (None, False),
    "conversation": (None,),
    "background": (None, False),
    "prompt": (None,),
}


def check_stateless(request: ResponsesRequest) -> None:
    for name, neutral in STATEFUL_FIELDS.items():
        value = getattr(request, name)
        if not any(value is allowed for allowed in neutral):
            raise APIError.bad_request(
                f"{name} is not supported: this server keeps no responses between requests "
                "(send the whole conversation as `input`, with store false or left out)",
                name,
            )


def _messages(request: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    items = request.input if isinstance(request.input, list) else None
    if items is None:
        return [*messages, {"role": "user", "content": request.input}]
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            reasoning = item.text()
        elif isinstance(item, FunctionCallItem):
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant" or "tool_calls" not in last:
                last = {"role": "assistant", "content": None, "tool_calls": []}
                messages.append(last)
            call = {"name": item.name, "arguments": item.arguments}
            last["tool_calls"].append({"id": item.call_id, "type": "function", "function": call})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output
            if not isinstance(output, str):
                output = "\n".join(part.text for part in output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            messages.append({"role": item.role, "content": item.text()})
        if reasoning is not None and messages and messages[-1]["role"] == "assistant":
            messages[-1]["reasoning"], reasoning = reasoning, None
    return messages


def to_chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request amounts to (400 naming what is refused)."""
    check_stateless(request)
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": _messages(request),
        "max_tokens": request.max_output_tokens,
        "stream": request.stream,
        "parallel_tool_calls": request.parallel_tool_calls,
    }
    if request.tools is not None:
        fields["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude={"type"})}
            for tool in request.tools
        ]
    choice = request.tool_choice
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    fields["tool_choice"] = choice
    if request.reasoning is not None and request.reasoning.effort is not None:
        fields["reasoning_effort"] = request.reasoning.effort
    for name in ("temperature", "top_p", "top_k", "seed", "user"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    if request.baton_disagg is not None:
        fields["baton_disagg"] = request.baton_disagg.model_dump()
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as error:
        message, param = describe_validation_errors(error.errors())
        raise APIError(400, message, param) from None


# The chat fields a Responses request's own fields became, for errors found on the chat side.
_RESPONSES_NAMES = {"messages": "input", "max_tokens": "max_output_tokens"}


@contextlib.contextmanager
def named_as_responses() -> Iterator[None]:
    """A 400 about the chat request names the Responses field it came from."""
    try:
        yield
    except APIError as error:
        param = _RESPONSES_NAMES.get(error.param or "", error.param)
        message = error.message
        for chat_name, name in _RESPONSES_NAMES.items():
            if message.startswith(chat_name):
                message = name + message[len(chat_name) :]
        raise APIError(error.status, message, param, error.code) from None
