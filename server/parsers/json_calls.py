"""Tool calls written as JSON: hermes / granite4 (<tool_call>{...}</tool_call>), nemotron_json
(<TOOLCALL>[{...}, ...]</TOOLCALL>), and the bare JSON a grammar forces (tool_choice "required":
an array of {"name", "parameters"}; a named function: its arguments object), as vLLM reads them.

A call is {"name": ..., "arguments": {...}} ("parameters" is read as "arguments", as vLLM's
required-choice schema writes it), alone or in a list. In the model's free text a call counts
only once its object is closed: until then the block may still prove malformed (one brace short,
an end tag inside it), and a malformed block is content, as vLLM and SGLang answer. So there a
call streams whole, when its "}" arrives. Only a text cut by the length limit makes a call of an
unfinished object (its arguments are then a prefix). Grammar-forced JSON cannot be malformed, so
there a call opens with its name and its arguments stream as they are written.

A block ends at the first end tag after its JSON value, so an argument that holds the end tag as
text (a model writing a parser's test file) does not cut it. Granite 4 writes "arguments" as a
JSON string holding the object: that string is decoded (any other string stays as it is).
"""

from __future__ import annotations

import json
from typing import NamedTuple

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
    function_name,
)
from baton.server.parsers.json_scan import JsonScanner, decode_string

_KEYS = frozenset({"name", "arguments", "parameters"})


class _Calls(NamedTuple):
    calls: tuple[ToolCallText, ...]
    read_to: int  # characters of the input up to the end of the last call (0: no call)


def _calls(scanner: JsonScanner, canonical: str, *, include_open: bool, finished: bool) -> _Calls:
    """The calls of the objects read so far: the closed ones, and with `include_open` the one
    still being written. `finished`: the text has ended (a call without arguments has {})."""
    calls, read_to = [], 0
    for item in sorted({item for item, _ in scanner.spans}, key=lambda item: item or 0):
        closed = item in scanner.ended_items
        name_span = scanner.spans.get((item, "name"))
        if (not closed and not include_open) or name_span is None or name_span[1] is None:
            continue
        written = decode_string(canonical[name_span[0] : name_span[1]])
        name = function_name(written) if written is not None else None
        if name is None:
            continue
        span = scanner.spans.get((item, "arguments")) or scanner.spans.get((item, "parameters"))
        if span is None:
            arguments = "{}" if closed or finished else ""
        elif span[1] is None:
            arguments = canonical[span[0] :]
        else:
            arguments = canonical[span[0] : span[1]]
            arguments = _serialized(arguments) if closed else arguments
        calls.append(ToolCallText(name=name, arguments=arguments))
        read_to = scanner.ended_items[item] if closed else scanner.consumed
    return _Calls(calls=tuple(calls), read_to=read_to)


def _serialized(arguments: str) -> str:
    """Arguments the model wrote as a JSON string holding a JSON object: that object."""
    if not arguments.startswith('"'):
        return arguments
    try:
        value = json.loads(json.loads(arguments))
        return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else arguments
    except (ValueError, TypeError, RecursionError):  # not JSON inside, or nested past the stack
        return arguments


class _JsonBlock:
    """One tagged block: its JSON, then up to its end tag."""

    def __init__(self, end_tag: str) -> None:
        self.end_tag = end_tag
        self.scanner = JsonScanner(tracked=_KEYS)
        self.fed = 0
        self.opened = False  # the body begins a JSON object or array
        self.text = False  # decided for good: it does not, the tag is text

    def read(self, body: str, end: TextEnd) -> Block | NotABlock | Undecided:
        if self.text:
            return NOT_A_BLOCK
        if not self.opened:
            stripped = body.lstrip()
            if not stripped:
                return UNDECIDED if end == "open" else NOT_A_BLOCK
            if stripped[0] not in "{[":
                self.text = True
                return NOT_A_BLOCK
            self.opened = True
        scanner = self.scanner
        scanner.feed(body[self.fed :])
        self.fed = len(body)
        finished = end != "open"
        canonical = scanner.finished_canonical() if finished else scanner.canonical
        stopped = scanner.done or scanner.error  # the JSON is over: what follows is not read
        close_at = body.find(self.end_tag, scanner.consumed) if stopped else -1
        cut = end == "length" and close_at == -1 and not scanner.error
        found = _calls(scanner, canonical, include_open=cut, finished=finished)
        closed = close_at != -1 or finished
        leftover = ""
        if closed and found.calls:
            stop = close_at if close_at != -1 else len(body)
            rest = body[scanner.consumed if scanner.done else found.read_to : stop]
            leftover = rest.strip().lstrip(",").strip()  # an array's separator is not text
        return Block(
            calls=found.calls,
            span=close_at + len(self.end_tag) if close_at != -1 else len(body),
            closed=closed,
            leftover=leftover,
        )


class TaggedJsonParser:
    """hermes / granite4 (<tool_call>{...}</tool_call>) and nemotron_json (<TOOLCALL>[...])."""

    def __init__(self, start: str, end: str) -> None:
        self.blocks = TaggedBlocks((start,), lambda _: _JsonBlock(end))

    def parse(self, text: str, end: TextEnd) -> ParsedContent:
        return self.blocks.parse(text, end)


class BareJsonParser:
    """The whole answer is JSON, as a grammar forces it: for tool_choice "required" an array
    of {"name", "parameters"}, for a named function its arguments object."""

    def __init__(self, function_name: str | None) -> None:
        self.function_name = function_name  # None: "required"
        self.scanner = JsonScanner(tracked=_KEYS if function_name is None else frozenset())
        self.fed = 0

    def parse(self, text: str, end: TextEnd) -> ParsedContent:
        scanner = self.scanner
        scanner.feed(text[self.fed :])
        self.fed = len(text)
        finished = end != "open"
        canonical = scanner.finished_canonical() if finished else scanner.canonical
        unread = ""
        if finished and (scanner.error or scanner.done):
            unread = text[scanner.consumed :].strip()
        if self.function_name is None:
            found = _calls(scanner, canonical, include_open=True, finished=finished)
            if finished and not found.calls:
                return ParsedContent(content=text, calls=())
            return ParsedContent(content=unread, calls=found.calls)
        if not canonical:  # nothing readable yet; at the end, the text is content
            return ParsedContent(content=text if finished else "", calls=())
        call = ToolCallText(name=self.function_name, arguments=canonical)
        return ParsedContent(content=unread, calls=(call,))
