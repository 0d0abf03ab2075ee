"""Tool-call parsers: the model's answer text -> content + tool calls, by `--tool-call-parser`.

Every parser is a function of the text so far and whether it is final, and returns only what
can no longer change (a suffix that may still become a tag, trailing whitespace that may turn
out to frame a tool call, a number not yet ended are held back). So the streamed answer is the
difference between successive parses, and the streamed pieces concatenate to exactly what one
parse of the whole text returns (tests/test_tool_parsers.py splits recorded texts at every
character to check it). Parsers keep per-block caches so a long streamed call is read once.

    text:  Let me check.\\n<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_call>
    parse: content "Let me check."   calls [f({"x": 1})]

Formats (vLLM's parser names):
  hermes, granite4   <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen3, Qwen3-Next,
                     Granite-4.0, Falcon-H1, the shipped model's template)
  nemotron_json      <TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL> (Nemotron
                     Nano 9B v2, as NVIDIA's vLLM plugin of that name)
  qwen3_coder        <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function>
                     </tool_call> (Nemotron 3, Qwen3.5, Qwen3-Coder); values typed by the
                     tool's JSON schema
and, not selectable, the bare JSON that a grammar forces for tool_choice "required" (an array
of {"name", "parameters"}) and for a named function (its arguments object), as vLLM does.

Text outside the blocks is content; whitespace that only frames a block is dropped. A block
that yields no call (not JSON, no name) is content as written; the unreadable rest of a block
that did yield calls is content too: nothing the model wrote is lost.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Any, Protocol

from baton.server.parsers.json_scan import JsonScanner, decode_string


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCallText:
    name: str
    arguments: str  # JSON text (a prefix of it while the call is still being written)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedContent:
    content: str
    calls: tuple[ToolCallText, ...]


class ToolCallParser(Protocol):
    def parse(self, text: str, final: bool) -> ParsedContent: ...


def held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


@dataclass(frozen=True, kw_only=True, slots=True)
class _Body:
    calls: tuple[ToolCallText, ...]
    unparsed: str  # text of a finished block that yielded nothing (content)


class _JsonCalls:
    """One block of JSON calls: {"name", "arguments"} or a list of them ("parameters" is
    accepted for "arguments", as vLLM's required-choice schema writes it)."""

    def __init__(self) -> None:
        self.scanner = JsonScanner(tracked=frozenset({"name", "arguments", "parameters"}))
        self.fed = 0

    def read(self, body: str, finished: bool) -> _Body:
        scanner = self.scanner
        scanner.feed(body[self.fed :])
        self.fed = len(body)
        canonical = scanner.finished_canonical() if finished else scanner.canonical
        items = sorted({item for item, _ in scanner.spans}, key=lambda item: item or 0)
        calls = []
        for item in items:
            name_span = scanner.spans.get((item, "name"))
            if name_span is None or name_span[1] is None:
                continue
            name = decode_string(canonical[name_span[0] : name_span[1]])
            if name is None:
                continue
            span = scanner.spans.get((item, "arguments")) or scanner.spans.get((item, "parameters"))
            if span is not None:
                arguments = canonical[span[0] : span[1] if span[1] is not None else len(canonical)]
            else:
                arguments = "{}" if item in scanner.ended_items or finished else ""
            calls.append(ToolCallText(name=name, arguments=arguments))
        unparsed = ""
        if finished:
            trailing = body[scanner.consumed :] if scanner.done else ""
            unread = body[scanner.consumed :] if scanner.error else trailing
            unparsed = body if not calls else unread.strip()
        return _Body(calls=tuple(calls), unparsed=unparsed)


class _TaggedBlocks:
    """Content, then blocks between `start` and `end`, each read by a body reader (cached per
    block, fed only the new text)."""

    def __init__(self, start: str, end: str, reader) -> None:
        self.start, self.end, self.reader = start, end, reader
        self.readers: dict[int, Any] = {}

    def parse(self, text: str, final: bool) -> ParsedContent:
        content: list[str] = []
        calls: list[ToolCallText] = []
        position, after_block = 0, False
        while True:
            block = text.find(self.start, position)
            if block == -1:
                segment = text[position:]
                if not final:  # may still grow into a tag, or turn out to frame one
                    segment = segment[: len(segment) - held_tag_prefix(segment, self.start)]
                    segment = segment.rstrip()
                content.append(segment.lstrip() if after_block else segment)
                break
            segment = text[position:block].rstrip()
            content.append(segment.lstrip() if after_block else segment)
            body_start = block + len(self.start)
            close = text.find(self.end, body_start)
            if close == -1:
                body = text[body_start:]
                if not final:
                    body = body[: len(body) - held_tag_prefix(body, self.end)]
            else:
                body = text[body_start:close]
            finished = close != -1 or final
            reader = self.readers.setdefault(block, self.reader())
            read = reader.read(body, finished)
            calls.extend(read.calls)
            if read.unparsed and not read.calls:
                content.append(text[block : close + len(self.end) if close != -1 else len(text)])
            elif read.unparsed:
                content.append(read.unparsed)
            if close == -1:
                break
            position, after_block = close + len(self.end), True
        return ParsedContent(content="".join(content), calls=tuple(calls))


class TaggedJsonParser:
    """hermes / granite4 (<tool_call>{...}</tool_call>) and nemotron_json (<TOOLCALL>[...])."""

    def __init__(self, start: str, end: str) -> None:
        self.blocks = _TaggedBlocks(start, end, _JsonCalls)

    def parse(self, text: str, final: bool) -> ParsedContent:
        return self.blocks.parse(text, final)


class BareJsonParser:
    """The whole answer is JSON, as a grammar forces it: for tool_choice "required" an array
    of {"name", "parameters"}, for a named function its arguments object."""

    def __init__(self, function_name: str | None) -> None:
        self.function_name = function_name  # None: "required"
        self.reader = _JsonCalls()
        self.scanner = JsonScanner(tracked=frozenset())
        self.fed = 0

    def parse(self, text: str, final: bool) -> ParsedContent:
        if self.function_name is None:
            read = self.reader.read(text, final)
            return ParsedContent(content=read.unparsed, calls=read.calls)
        self.scanner.feed(text[self.fed :])
        self.fed = len(text)
        arguments = self.scanner.finished_canonical() if final else self.scanner.canonical
        unparsed = ""
        if final and (self.scanner.error or self.scanner.done):
            unparsed = text[self.scanner.consumed :].strip()
        if not arguments:  # nothing readable yet; at the end, the text is content
            return ParsedContent(content=text if final else "", calls=())
        call = ToolCallText(name=self.function_name, arguments=arguments)
        return ParsedContent(content=unparsed, calls=(call,))


_FUNCTION, _PARAMETER = "<function=", "<parameter="
_FUNCTION_END, _PARAMETER_END = "</function>", "</parameter>"


class _XmlCall:
    """One qwen3_coder block: <function=NAME> then <parameter=KEY>VALUE</parameter>s. A
    parameter goes out whole (its type decides its JSON), so arguments grow one at a time."""

    def __init__(self, types_of) -> None:
        self.types_of = types_of  # function name -> {argument: its schema's "type"}

    def read(self, body: str, finished: bool) -> _Body:
        opened = body.find(_FUNCTION)
        name_end = body.find(">", opened) if opened != -1 else -1
        if name_end == -1:
            return _Body(calls=(), unparsed=body if finished else "")
        name = body[opened + len(_FUNCTION) : name_end].strip()
        types = self.types_of(name)
        parameters: list[str] = []
        position, closed = name_end + 1, finished
        while True:
            parameter = body.find(_PARAMETER, position)
            function_end = body.find(_FUNCTION_END, position)
            if function_end != -1 and (parameter == -1 or function_end < parameter):
                closed, position = True, function_end + len(_FUNCTION_END)
                break
            key_end = body.find(">", parameter) if parameter != -1 else -1
            if key_end == -1:
                break
            ends = [
                at
                for at in (
                    body.find(_PARAMETER_END, key_end),
                    body.find(_PARAMETER, key_end),  # vLLM tolerates a missing </parameter>
                    body.find(_FUNCTION_END, key_end),
                )
                if at != -1
            ]
            if not ends and not finished:
                break
            value_end = min(ends) if ends else len(body)
            key = body[parameter + len(_PARAMETER) : key_end].strip()
            value = _trim_newlines(body[key_end + 1 : value_end])
            typed = typed_value(value, types.get(key))
            parameters.append(f"{json.dumps(key, ensure_ascii=False)}: {typed}")
            at_end = body.startswith(_PARAMETER_END, value_end)
            position = value_end + (len(_PARAMETER_END) if at_end else 0)
        arguments = "{" + ", ".join(parameters) + ("}" if closed else "")
        unparsed = body[position:].strip() if finished and closed else ""
        return _Body(calls=(ToolCallText(name=name, arguments=arguments),), unparsed=unparsed)


def _trim_newlines(value: str) -> str:
    """One newline each side is the template's layout, not the value."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


_INTEGER = re.compile(r"-?\d+")


def typed_value(value: str, schema_type: Any) -> str:
    """A qwen3_coder parameter as JSON, by its schema type (a string when it does not fit,
    or when the schema gives no type), as vLLM coerces them."""
    types = [schema_type] if isinstance(schema_type, str) else schema_type
    types = [kind for kind in types if isinstance(kind, str)] if isinstance(types, list) else []
    for kind in ("null", "integer", "number", "boolean", "object", "array"):
        if kind not in types:
            continue
        stripped = value.strip()
        if kind == "null" and stripped.lower() == "null":
            return "null"
        if kind == "integer" and _INTEGER.fullmatch(stripped) and len(stripped) < 4000:
            return str(int(stripped))
        if kind == "number":
            try:
                number = float(stripped)
            except ValueError:
                continue
            if math.isfinite(number):
                return json.dumps(int(number) if number.is_integer() else number)
        if kind == "boolean" and stripped.lower() in ("true", "false"):
            return stripped.lower()
        if kind in ("object", "array"):
            try:
                parsed = json.loads(stripped)
            except ValueError:
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return json.dumps(parsed, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False)


def _property_types(parameters: Any) -> dict[str, Any]:
    """Each argument's declared JSON type, from a tool's parameters schema (whatever shape a
    client sent: anything that is not a schema object declares no type)."""
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict):
        return {}
    return {
        key: schema.get("type") for key, schema in properties.items() if isinstance(schema, dict)
    }


class Qwen3CoderParser:
    def __init__(self, tools: list[dict]) -> None:
        types = {
            tool["function"]["name"]: _property_types(tool["function"].get("parameters"))
            for tool in tools
        }
        self.blocks = _TaggedBlocks(
            "<tool_call>", "</tool_call>", lambda: _XmlCall(lambda name: types.get(name, {}))
        )

    def parse(self, text: str, final: bool) -> ParsedContent:
        return self.blocks.parse(text, final)


TOOL_CALL_PARSERS = ("hermes", "granite4", "qwen3_coder", "nemotron_json")


def make_tool_parser(name: str, tools: list[dict]) -> ToolCallParser:
    """A fresh parser (they cache per request) for `--tool-call-parser NAME`."""
    if name in ("hermes", "granite4"):
        return TaggedJsonParser("<tool_call>", "</tool_call>")
    if name == "nemotron_json":
        return TaggedJsonParser("<TOOLCALL>", "</TOOLCALL>")
    if name == "qwen3_coder":
        return Qwen3CoderParser(tools)
    raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
