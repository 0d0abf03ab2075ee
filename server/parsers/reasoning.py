"""Reasoning parsers: the thinking text apart from the answer, by `--reasoning-parser`.

All three read <think>...</think> (vLLM's names and rules):
  deepseek_r1   the start tag is optional (the template may have written it); without an end
                tag, everything is reasoning
  qwen3         the same, and enable_thinking false (chat_template_kwargs / reasoning_effort
                "none") means no reasoning at all; a <tool_call> followed by <function= ends
                the reasoning without </think> (Qwen3.5 does that), and the </think> that then
                follows the call closes the interrupted thinking: it is dropped, not content
  nemotron_v3   as qwen3 (Nemotron 3 writes Qwen3's format); vLLM's and SGLang's
                force_nonempty_content (reasoning moved into an empty answer) is not taken: a
                stream cannot take back the reasoning it sent
<think> tags the output opens with, and whitespace around them, are markers, not reasoning.

Where the output starts (thinking or answering) comes from the prompt: when the rendered prompt
already closed a thinking block after its last opening (a template given enable_thinking false
writes "<think></think>"), the output is the answer, unless it opens a new <think> itself (an
older template that keeps past reasoning in the history). Like the tool parsers, a split is a
function of the text so far: a suffix that may still become a tag is held back, so streamed
pieces concatenate to the split of the whole text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from baton.server.parsers.blocks import held_tag_prefix

THINK_START, THINK_END = "<think>", "</think>"
_TOOL_CALL, _TOOL_CALL_END, _FUNCTION = "<tool_call>", "</tool_call>", "<function="


@dataclass(frozen=True, kw_only=True, slots=True)
class ReasoningFormat:
    name: str
    honours_enable_thinking: bool  # enable_thinking false: the whole output is the answer
    tool_call_ends_reasoning: bool  # <tool_call><function=... ends the reasoning implicitly


REASONING_FORMATS = {
    "deepseek_r1": ReasoningFormat(
        name="deepseek_r1", honours_enable_thinking=False, tool_call_ends_reasoning=False
    ),
    "qwen3": ReasoningFormat(
        name="qwen3", honours_enable_thinking=True, tool_call_ends_reasoning=True
    ),
    "nemotron_v3": ReasoningFormat(
        name="nemotron_v3", honours_enable_thinking=True, tool_call_ends_reasoning=True
    ),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class ReasoningSplit:
    reasoning: str
    answer: str  # the text after the reasoning (final so far)


def starts_thinking(
    reasoning_format: ReasoningFormat, prompt: str, template_variables: dict[str, Any]
) -> bool:
    """Whether the output begins inside a thinking block."""
    if (
        reasoning_format.honours_enable_thinking
        and template_variables.get("enable_thinking") is False
    ):
        return False
    return prompt.rfind(THINK_END) <= prompt.rfind(THINK_START)


class ReasoningSplitter:
    def __init__(self, reasoning_format: ReasoningFormat, thinking: bool) -> None:
        self.format = reasoning_format
        self.thinking = thinking

    def split(self, text: str, final: bool) -> ReasoningSplit:
        opened = _after_opening_tags(text, final)
        if opened is None:
            return ReasoningSplit(reasoning="", answer="")  # may open a <think> yet
        if not self.thinking and opened == 0:
            return ReasoningSplit(reasoning="", answer=text)
        text = text[opened:]
        end = text.find(THINK_END)
        implicit = self._tool_call_end(text, end)
        if implicit is not None and (end == -1 or implicit < end):
            answer = _without_interrupted_end(text[implicit:], final)
            return ReasoningSplit(reasoning=text[:implicit], answer=answer)
        if end != -1:
            return ReasoningSplit(reasoning=text[:end], answer=text[end + len(THINK_END) :])
        if final:  # cut before the end tag (a length limit): all of it is reasoning
            return ReasoningSplit(reasoning=text, answer="")
        held = held_tag_prefix(text, THINK_END)
        if self.format.tool_call_ends_reasoning:
            held = max(held, held_tag_prefix(text, _TOOL_CALL))
            pending = self._pending_tool_call(text)
            if pending is not None:
                held = max(held, len(text) - pending)
        return ReasoningSplit(reasoning=text[: len(text) - held], answer="")

    def _tool_call_end(self, text: str, before: int) -> int | None:
        """Where a genuine <tool_call> (one followed by <function=) starts, if it comes before
        `before` (-1: anywhere)."""
        if not self.format.tool_call_ends_reasoning:
            return None
        position = 0
        while True:
            at = text.find(_TOOL_CALL, position)
            if at == -1 or (before != -1 and at > before):
                return None
            after = text[at + len(_TOOL_CALL) :].lstrip()
            if after.startswith(_FUNCTION):
                return at
            position = at + 1

    def _pending_tool_call(self, text: str) -> int | None:
        """The start of a trailing <tool_call> that <function= may still follow."""
        at = text.rfind(_TOOL_CALL)
        if at == -1:
            return None
        after = text[at + len(_TOOL_CALL) :].lstrip()
        return at if _FUNCTION.startswith(after) else None


def _after_opening_tags(text: str, final: bool) -> int | None:
    """Where the text begins after the <think> tags it opens with (0: it opens with none);
    None while it may still turn out to open with one."""
    position = 0
    while True:
        stripped = text[position:].lstrip()
        if stripped.startswith(THINK_START):
            position = len(text) - len(stripped) + len(THINK_START)
        elif not final and THINK_START.startswith(stripped):
            return None
        else:
            return position


def _without_interrupted_end(answer: str, final: bool) -> str:
    """The answer after a tool call ended the thinking early, less the </think> that the model
    writes after the call (right after a </tool_call>) to close the thinking it interrupted; a
    suffix that may still become that tag is held back."""
    position = 0
    while (close := answer.find(_TOOL_CALL_END, position)) != -1:
        after = close + len(_TOOL_CALL_END)
        stripped = answer[after:].lstrip()
        at = len(answer) - len(stripped)
        if stripped.startswith(THINK_END):
            return answer[:at] + answer[at + len(THINK_END) :]
        if not final and THINK_END.startswith(stripped):
            return answer[:at]
        position = after
    return answer


REASONING_PARSERS = tuple(REASONING_FORMATS)
