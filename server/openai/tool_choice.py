"""What a chat request's tools, tool_choice and the server's parsers make of one generation.

    tool_choice     prompt                 sampling                       answer
    none / absent   tools in the template  as asked                       text (+ reasoning)
    auto            tools in the template  as asked                       --tool-call-parser's calls
    required        tools in the template  grammar: [{name, parameters}]  those calls
    {function: f}   tools in the template  grammar: f's arguments         one call of f

As vLLM: tools without tool_choice mean "auto"; "auto" needs --enable-auto-tool-choice (400
naming the flags when no parser is set; with a parser but without the flag, the text comes back
unparsed); the grammar applies after the reasoning ends (StructuredOutputs.after_token_ids is
the reasoning end tag's ids, or empty when the prompt already closed the thinking block). A
forced call finishes with "tool_calls" ("stop" for a named function, as OpenAI answers).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from baton.engine.core.sampling_params import SamplingParams, StructuredOutputs
from baton.engine.structured_output.schema.document import subschemas
from baton.server.errors import APIError
from baton.server.openai.protocol import ChatCompletionRequest, ChatTool, NamedToolChoice
from baton.server.parsers.json_calls import BareJsonParser
from baton.server.parsers.output import OutputParser, ParserSettings
from baton.server.parsers.reasoning import (
    REASONING_FORMATS,
    THINK_END,
    ReasoningSplitter,
    starts_thinking,
)
from baton.server.parsers.tools import make_tool_parser


def effective_tool_choice(request: ChatCompletionRequest) -> str | NamedToolChoice:
    if request.tool_choice is not None:
        return request.tool_choice
    return "auto" if request.tools else "none"


def check_tools(request: ChatCompletionRequest) -> None:
    """The rules that need no model (the router applies them too)."""
    if request.tools is not None and not request.tools:
        raise APIError.bad_request(
            "tools must not be an empty array: give at least one tool or leave it out", "tools"
        )
    choice = request.tool_choice
    if choice not in (None, "none") and not request.tools:
        raise APIError.bad_request("tool_choice needs tools to choose from", "tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [tool.function.name for tool in request.tools or []]
        if choice.function.name not in names:
            raise APIError.bad_request(
                f"tool_choice names function {choice.function.name!r}, which is not in tools "
                f"({', '.join(names)})",
                "tool_choice",
            )


def named_schema(tool: ChatTool) -> dict[str, Any]:
    """The arguments object of one function (an empty object when it declares none)."""
    return tool.function.parameters or {"type": "object", "properties": {}}


def required_schema(tools: list[ChatTool], parallel_tool_calls: bool | None) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a non-empty array of {name, parameters}, one
    item shape per tool. Each tool's parameters sit whole under `$defs` (`tool_0`, ...), with
    their `$ref`s rebased there: a reference resolves in the tool's own schema ("#" is its
    parameters, not this array), and two tools' `$defs` of the same name stay apart."""
    definitions = {
        f"tool_{index}": _rebased(named_schema(tool), f"#/$defs/tool_{index}")
        for index, tool in enumerate(tools)
    }
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": {"$ref": f"#/$defs/tool_{index}"},
                    },
                    "required": ["name", "parameters"],
                }
                for index, tool in enumerate(tools)
            ],
        },
        "$defs": definitions,
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each `$ref` into itself ("#", "#/...") pointing under `base` instead (only
    `$ref` keywords: a property named "$ref" or a const holding one is left as it is)."""
    if not isinstance(schema, dict):
        return schema
    rebased = dict(schema)
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        rebased["$ref"] = base + ref[1:]
    for parts, sub in subschemas(schema):
        holder = rebased
        for part in parts[:-1]:
            holder[part] = holder[part].copy()  # (copied on the way down: the tool is the user's)
            holder = holder[part]
        holder[parts[-1]] = _rebased(sub, base)
    return rebased


@dataclass(frozen=True, kw_only=True, slots=True)
class ChatOutputPlan:
    """How the text of each choice is read, and what the sampling needs for it."""

    settings: ParserSettings
    tool_choice: str | NamedToolChoice
    tools: list[ChatTool]
    thinking: bool  # the output starts inside a thinking block
    parses_tools: bool
    parallel_tool_calls: bool | None  # false: one call at most

    @property
    def max_calls(self) -> int | None:
        return 1 if self.parallel_tool_calls is False else None

    @property
    def has_reasoning_parser(self) -> bool:
        return self.settings.reasoning_parser is not None

    @property
    def forced(self) -> bool:
        """A call is forced by a grammar: tool_choice "required" or a named function."""
        return self.tool_choice == "required" or self.named is not None

    @property
    def parses(self) -> bool:
        return self.parses_tools or self.forced or self.has_reasoning_parser

    @property
    def named(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def parser(self) -> OutputParser:
        """A fresh parser for one choice (parsers cache per text)."""
        splitter = None
        if self.settings.reasoning_parser is not None:
            reasoning_format = REASONING_FORMATS[self.settings.reasoning_parser]
            splitter = ReasoningSplitter(reasoning_format, self.thinking)
        tools = None
        if self.forced:
            tools = BareJsonParser(self.named)
        elif self.parses_tools:
            assert self.settings.tool_call_parser is not None
            tools = make_tool_parser(
                self.settings.tool_call_parser, [tool.model_dump() for tool in self.tools]
            )
        return OutputParser(splitter, tools)

    def sampling(self, params: SamplingParams, reasoning_end_ids: list[int]) -> SamplingParams:
        """The grammar of a forced call, or the request's own (response_format...) moved to
        after the reasoning; special tokens kept when tool tags may be special ones."""
        changes: dict[str, Any] = {}
        after = tuple(reasoning_end_ids) if self.has_reasoning_parser and self.thinking else ()
        schema = None
        if self.named is not None:
            tool = next(tool for tool in self.tools if tool.function.name == self.named)
            schema = named_schema(tool)
        elif self.tool_choice == "required":
            schema = required_schema(self.tools, self.parallel_tool_calls)
        given = params.structured_outputs
        if schema is not None and given is not None:
            raise APIError.bad_request(
                "a forced tool_choice and a structured output (response_format, "
                "structured_outputs, guided_*) cannot both constrain the answer",
                "tool_choice",
            )
        if schema is not None:
            changes["structured_outputs"] = StructuredOutputs(
                kind="json", spec=json.dumps(schema), after_token_ids=after
            )
        elif given is not None and after:
            changes["structured_outputs"] = dataclasses.replace(given, after_token_ids=after)
        if self.parses_tools and self.settings.tool_call_parser != "qwen3_coder":
            # vLLM's hermes / granite4: <tool_call> is a special token in some vocabularies
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params

    def finish_reason(self, engine_reason: str | None, made_calls: bool) -> str | None:
        if made_calls and self.named is None and engine_reason == "stop":
            return "tool_calls"
        return engine_reason


def plan_output(
    request: ChatCompletionRequest,
    settings: ParserSettings,
    prompt: str,
    template_variables: dict[str, Any],
) -> ChatOutputPlan:
    """The plan for a request whose model-free rules passed; 400 for a tool_choice the server's
    flags cannot serve (vLLM's messages)."""
    choice = effective_tool_choice(request)
    if choice == "auto" and settings.tool_call_parser is None:
        raise APIError.bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
            "to be set",
            "tool_choice",
        )
    thinking = settings.reasoning_parser is not None and starts_thinking(
        REASONING_FORMATS[settings.reasoning_parser], prompt, template_variables
    )
    return ChatOutputPlan(
        settings=settings,
        tool_choice=choice,
        tools=list(request.tools or []),
        thinking=thinking,
        parses_tools=choice == "auto" and settings.enable_auto_tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
    )


def reasoning_end_ids(tokenizer, settings: ParserSettings) -> list[int]:
    if settings.reasoning_parser is None:
        return []
    return tokenizer.encode(THINK_END, add_special_tokens=False)
