"""One choice's generated text -> reasoning, content and tool calls, whole or as stream deltas.

    text ──ReasoningSplitter──> reasoning | answer ──tool-call parser──> content | calls

Both stages are functions of the text so far (and of how it ended: still open, stopped by the
model, or cut by the length limit) that return only what can no longer change, so
`OutputStream` streams the difference between successive parses, and the concatenation of its
deltas is exactly `OutputParser.parse(whole text, end)`.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from baton.server.parsers.blocks import TextEnd, ToolCallParser, ToolCallText
from baton.server.parsers.reasoning import ReasoningSplitter


@dataclass(frozen=True, kw_only=True, slots=True)
class ParserSettings:
    """The server's flags: --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser."""

    tool_call_parser: str | None
    enable_auto_tool_choice: bool
    reasoning_parser: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedOutput:
    reasoning: str
    content: str
    calls: tuple[ToolCallText, ...]


class OutputParser:
    def __init__(self, splitter: ReasoningSplitter | None, tools: ToolCallParser | None) -> None:
        self.splitter = splitter
        self.tools = tools

    def parse(self, text: str, end: TextEnd) -> ParsedOutput:
        reasoning, answer = "", text
        if self.splitter is not None:
            split = self.splitter.split(text, final=end != "open")
            reasoning, answer = split.reasoning, split.answer
        if self.tools is None:
            return ParsedOutput(reasoning=reasoning, content=answer, calls=())
        parsed = self.tools.parse(answer, end)
        return ParsedOutput(reasoning=reasoning, content=parsed.content, calls=parsed.calls)


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"  # vLLM's form


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputDelta:
    reasoning: str
    content: str
    tool_calls: list[dict]  # OpenAI's delta entries: {"index", ["id", "type"], "function"}

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputStream:
    """Deltas of one choice. A call opens with its index, id, type and name (and whatever
    arguments are already known, else ""), then its arguments arrive in fragments, as OpenAI
    and vLLM stream them."""

    def __init__(self, parser: OutputParser) -> None:
        self.parser = parser
        self.sent = ParsedOutput(reasoning="", content="", calls=())
        self.call_ids: list[str] = []

    def update(self, text: str, end: TextEnd) -> OutputDelta:
        parsed = self.parser.parse(text, end)
        sent = self.sent
        tool_calls = []
        for index, call in enumerate(parsed.calls):
            if index < len(sent.calls):
                fragment = _growth(sent.calls[index].arguments, call.arguments, "arguments")
                if fragment:
                    tool_calls.append({"index": index, "function": {"arguments": fragment}})
                continue
            self.call_ids.append(new_tool_call_id())
            tool_calls.append(
                {
                    "index": index,
                    "id": self.call_ids[index],
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            )
        if len(parsed.calls) < len(sent.calls):
            raise RuntimeError("output parser dropped a tool call it had streamed")
        delta = OutputDelta(
            reasoning=_growth(sent.reasoning, parsed.reasoning, "reasoning"),
            content=_growth(sent.content, parsed.content, "content"),
            tool_calls=tool_calls,
        )
        self.sent = parsed
        return delta


def _growth(before: str, after: str, what: str) -> str:
    """What `after` adds to `before`; a parser that took back text it streamed is a bug."""
    if not after.startswith(before):
        raise RuntimeError(f"output parser changed {what} it had streamed")
    return after[len(before) :]


def message_fields(
    parsed: ParsedOutput, call_ids: list[str] | None, *, has_reasoning_parser: bool
) -> dict:
    """The assistant message's content, reasoning and tool_calls (ids: the streamed ones, or
    new). Content is null when calls or a reasoning parser leave none, as vLLM and OpenAI
    answer; without either it stays the text, even empty."""
    ids = call_ids or [new_tool_call_id() for _ in parsed.calls]
    fields: dict = {
        "content": parsed.content or (None if parsed.calls or has_reasoning_parser else ""),
    }
    if has_reasoning_parser:
        fields["reasoning"] = parsed.reasoning or None
    if parsed.calls:
        fields["tool_calls"] = [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call_id, call in zip(ids, parsed.calls, strict=True)
        ]
    return fields
