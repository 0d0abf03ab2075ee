"""qwen3_coder: tool calls as XML-like tags (Nemotron 3, Qwen3.5, Qwen3-Coder), values typed by
the tool's JSON schema (server/parsers/param_types.py).

    <tool_call>
    <function=write_file>
    <parameter=path>
    a.py
    </parameter>
    <parameter=content>
    print("</parameter>")
    </parameter>
    </function>
    </tool_call>          ->  write_file({"path": "a.py", "content": "print(\"</parameter>\")"})

A `<function=NAME>` without the `<tool_call>` around it is a call too (both peers recover it);
a NAME no function has (`bad\n</function`, `{{ tc.name }}`) makes the tags text. One call per
block: what follows `</function>` inside the block is content. One newline each side of a value
is the template's layout, not the value.

A value may hold these tags as text (an agent writing a parser's fixture, a chat template), so a
value ends only at a tag that continues the call:
  - `</parameter>` followed (after whitespace) by `<parameter=K>`, `</function>`, `</tool_call>`
    or the end of the text, where K is a parameter of the tool (any name when the tool declares
    none) not given yet;
  - a model that forgot `</parameter>`: at the next line that opens such a `<parameter=K>`, or at
    `</function>` followed by `</tool_call>` or the end;
and tags the value opens itself (`<parameter=…>`, `<function=…>`) nest: their closers are text.
A parameter goes out whole, once its end is known, so arguments grow one parameter at a time.
"""

from __future__ import annotations

import json
import re

from baton.server.parsers.blocks import (
    NOT_A_BLOCK,
    UNDECIDED,
    Block,
    NotABlock,
    ParsedContent,
    TaggedBlocks,
    TextEnd,
    ToolCallText,
    Undecided,
    cannot_become_name,
    function_name,
)
from baton.server.parsers.param_types import declared_types, typed_value

TOOL_CALL, TOOL_CALL_END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_CONTINUATIONS = (PARAMETER, FUNCTION_END, TOOL_CALL_END)  # what may follow a parameter
_NEXT_CONTINUATION = re.compile("|".join(map(re.escape, _CONTINUATIONS)))
_TAGS = re.compile(
    "|".join(map(re.escape, (PARAMETER, PARAMETER_END, FUNCTION, FUNCTION_END, TOOL_CALL_END)))
)
# What must follow a closer, outside tags the value opened, for it to end the value (besides
# the end of the text; a `<parameter=K>` counts only for a K that may come next)
_ENDS_AFTER = {
    PARAMETER_END: (PARAMETER, FUNCTION_END, TOOL_CALL_END),
    FUNCTION_END: (TOOL_CALL_END, TOOL_CALL, FUNCTION),
    TOOL_CALL_END: (),
}
_SPACE = re.compile(r"\s*")


class _Tool:
    """What the parser knows of a function: each parameter's declared types."""

    def __init__(self, parameters_schema) -> None:
        properties = (
            parameters_schema.get("properties") if isinstance(parameters_schema, dict) else None
        )
        properties = properties if isinstance(properties, dict) else {}
        self.types = {key: declared_types(schema) for key, schema in properties.items()}


class _XmlCall:
    """One block, from after `<tool_call>` (`wrapped`) or after a bare `<function=`."""

    def __init__(self, wrapped: bool, tools: dict[str, _Tool]) -> None:
        self.wrapped = wrapped
        self.tools = tools
        self.name: str | None = None
        self.text = False  # decided for good: the tag is text
        self.types: dict[str, tuple[str, ...]] = {}
        # progress kept between reads: the finished parameters and where the next one begins
        self.parameters: list[str] = []
        self.seen: set[str] = set()
        self.position = 0
        self.between: list[str] = []  # text between parameters (content)

    def read(self, body: str, end: TextEnd) -> Block | NotABlock | Undecided:
        if self.text:
            return NOT_A_BLOCK
        if self.name is None:
            header = self._header(body, end)
            if not isinstance(header, int):
                return header
            self.position = header
        return self._parameters(body, end)

    def _header(self, body: str, end: TextEnd) -> int | NotABlock | Undecided:
        """Where the parameters begin, after `<function=NAME>` (NAME checked)."""
        opened = 0
        if self.wrapped:
            opened = _SPACE.match(body).end()
            if not body.startswith(FUNCTION, opened):
                if FUNCTION.startswith(body[opened:]):
                    return UNDECIDED if end == "open" else NOT_A_BLOCK
                self.text = True
                return NOT_A_BLOCK
            opened += len(FUNCTION)
        closer = body.find(">", opened)
        written = body[opened:] if closer == -1 else body[opened:closer]
        if cannot_become_name(written) or (closer != -1 and function_name(written) is None):
            self.text = True
            return NOT_A_BLOCK
        if closer == -1:
            return UNDECIDED if end == "open" else NOT_A_BLOCK
        self.name = function_name(written)
        tool = self.tools.get(self.name)
        self.types = tool.types if tool is not None else {}
        return closer + 1

    def _parameters(self, body: str, end: TextEnd) -> Block:
        finished = end != "open"
        while True:
            at = _SPACE.match(body, self.position).end()
            if body.startswith(PARAMETER, at):
                closer = body.find(">", at)
                if closer == -1:
                    if finished:  # a tag cut off: the call ends with the text
                        return self._block(len(body), True, closed=True)
                    return self._block(len(body), False, closed=False)
                key = body[at + len(PARAMETER) : closer].strip()
                value_end = self._value_end(body, closer + 1, key, end)
                if value_end is None:
                    return self._block(len(body), False, closed=False)
                value, self.position = value_end
                self._add(key, body[closer + 1 : value])
                continue
            if body.startswith(FUNCTION_END, at):
                return self._after_function(body, at + len(FUNCTION_END), end)
            if body.startswith(TOOL_CALL_END, at):
                return self._block(at + len(TOOL_CALL_END), True, closed=True)
            rest = body[at:]
            if not finished and any(tag.startswith(rest) for tag in _CONTINUATIONS):
                return self._block(len(body), False, closed=False)
            found = _NEXT_CONTINUATION.search(body, at)
            if found is None:
                if finished:
                    return self._block(len(body), True, closed=True, text=rest)
                return self._block(len(body), False, closed=False)
            self.between.append(body[at : found.start()])
            self.position = found.start()

    def _after_function(self, body: str, after: int, end: TextEnd) -> Block:
        """The call is complete; the block ends at `</tool_call>` (wrapped: text before it is
        content; bare: only a `</tool_call>` right after belongs to it)."""
        at = _SPACE.match(body, after).end()
        if body.startswith(TOOL_CALL_END, at):
            return self._block(at + len(TOOL_CALL_END), True, closed=True)
        rest = body[at:]
        if end == "open" and TOOL_CALL_END.startswith(rest):
            return self._block(len(body), True, closed=False)
        if not self.wrapped:
            return self._block(after, True, closed=True)
        close = body.find(TOOL_CALL_END, at)
        if close == -1:
            if end == "open":
                return self._block(len(body), True, closed=False)
            return self._block(len(body), True, closed=True, text=rest)
        span = close + len(TOOL_CALL_END)
        return self._block(span, True, closed=True, text=body[at:close])

    def _value_end(self, body: str, start: int, key: str, end: TextEnd) -> tuple[int, int] | None:
        """(where the value ends, where the next tag begins), or None while undecided."""
        finished = end != "open"
        seen = self.seen | {key}

        def opens(name: str) -> bool:  # may `<parameter=name>` begin the next parameter
            return name not in seen and (not self.types or name in self.types)

        parameters = functions = 0  # tags the value opened itself
        for tag in _TAGS.finditer(body, start):
            at, after = tag.start(), tag.end()
            if tag.group() == PARAMETER:
                closer = body.find(">", after)
                if closer == -1:
                    if not finished:
                        return None
                    continue
                name = function_name(body[after:closer])
                if name is None:  # `<parameter=` and text: no tag
                    continue
                line_start = at > start and body[at - 1] == "\n"
                if not parameters and not functions and line_start and opens(name):
                    return at, at  # the model forgot </parameter>
                parameters += 1
            elif tag.group() == FUNCTION:
                functions += 1
            elif parameters or functions:
                if tag.group() == PARAMETER_END and parameters:
                    parameters -= 1
                elif tag.group() == FUNCTION_END and functions and not parameters:
                    functions -= 1
            else:
                ending = self._ends_value(body, after, tag.group(), end, opens)
                if ending is None:
                    return None
                if ending and tag.group() == PARAMETER_END:
                    return at, after
                if ending:
                    return _before_own_close(body, start, at), at
        return None if not finished else (_before_own_close(body, start, len(body)), len(body))

    def _ends_value(self, body: str, after: int, tag: str, end: TextEnd, opens) -> bool | None:
        """Whether a closing `tag` outside nested tags ends the value, by what follows it."""
        at = _SPACE.match(body, after).end()
        if at == len(body):
            return None if end == "open" else True
        follows = _ENDS_AFTER[tag]
        if PARAMETER in follows and body.startswith(PARAMETER, at):
            closer = body.find(">", at)
            if closer == -1:
                return None if end == "open" else False
            return opens(body[at + len(PARAMETER) : closer].strip())
        if any(body.startswith(follower, at) for follower in follows):
            return True
        rest = body[at : at + max(map(len, follows), default=0)]
        if end == "open" and any(follower.startswith(rest) for follower in follows):
            return None
        return False

    def _add(self, key: str, value: str) -> None:
        if not key or key in self.seen:  # a repeated key keeps its first value
            return
        self.seen.add(key)
        typed = typed_value(_trim_newlines(value), self.types.get(key, ()))
        self.parameters.append(f"{json.dumps(key, ensure_ascii=False)}: {typed}")

    def _block(self, span: int, function_closed: bool, *, closed: bool, text: str = "") -> Block:
        """The call as read so far; `text`: what the block holds after it (content)."""
        arguments = "{" + ", ".join(self.parameters) + ("}" if function_closed else "")
        call = ToolCallText(name=self.name or "", arguments=arguments)
        leftover = "".join([*self.between, text]).strip() if closed else ""
        return Block(calls=(call,), span=span, closed=closed, leftover=leftover)


def _before_own_close(body: str, start: int, end: int) -> int:
    """Where a value that ends without its `</parameter>` ends: before a `</parameter>` that
    closes it, all the same (taken for a tag the value opened, as `<parameter=path>` in a
    fixture's text that never closes it)."""
    kept = body[start:end].rstrip()
    return start + len(kept) - len(PARAMETER_END) if kept.endswith(PARAMETER_END) else end


def _trim_newlines(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderParser:
    def __init__(self, tools: list[dict]) -> None:
        known = {
            tool["function"]["name"]: _Tool(tool["function"].get("parameters")) for tool in tools
        }
        self.blocks = TaggedBlocks(
            (TOOL_CALL, FUNCTION), lambda tag: _XmlCall(tag == TOOL_CALL, known)
        )

    def parse(self, text: str, end: TextEnd) -> ParsedContent:
        return self.blocks.parse(text, end)
