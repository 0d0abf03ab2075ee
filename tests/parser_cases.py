"""Run recorded model outputs through baton's output parser whole and streamed: the streamed
deltas, rebuilt into a message, must equal the whole-text parse at every chunking (each chunk
size from 1 to the text's length, and each single cut)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from baton.server.parsers.blocks import TextEnd
from baton.server.parsers.json_calls import BareJsonParser
from baton.server.parsers.output import OutputParser, OutputStream
from baton.server.parsers.reasoning import REASONING_FORMATS, ReasoningSplitter
from baton.server.parsers.tools import make_tool_parser

MakeParser = Callable[[], OutputParser]


@dataclass(frozen=True, kw_only=True, slots=True)
class Parsed:
    reasoning: str
    content: str
    calls: tuple[tuple[str, str], ...]  # (name, arguments JSON text)


def output_parser(
    tool_parser: str | None,
    reasoning: str | None = None,
    *,
    thinking: bool = True,
    tools: list[dict] | None = None,
) -> MakeParser:
    """A maker of fresh parsers: `tool_parser` a --tool-call-parser name, or "bare:" /
    "bare:NAME" for a grammar-forced answer ("required" / a named function)."""

    def make() -> OutputParser:
        splitter = ReasoningSplitter(REASONING_FORMATS[reasoning], thinking) if reasoning else None
        if tool_parser is None:
            calls = None
        elif tool_parser.startswith("bare:"):
            calls = BareJsonParser(tool_parser[len("bare:") :] or None)
        else:
            calls = make_tool_parser(tool_parser, tools or [])
        return OutputParser(splitter, calls)

    return make


def whole(make: MakeParser, text: str, end: TextEnd = "stop") -> Parsed:
    parsed = make().parse(text, end)
    calls = tuple((call.name, call.arguments) for call in parsed.calls)
    return Parsed(reasoning=parsed.reasoning, content=parsed.content, calls=calls)


def streamed(make: MakeParser, pieces: list[str], end: TextEnd = "stop") -> Parsed:
    """Feed `pieces` as they would arrive; rebuild the message from the deltas alone."""
    stream = OutputStream(make())
    reasoning, content, calls = "", "", []
    text = ""
    for number, piece in enumerate(pieces):
        text += piece
        delta = stream.update(text, end if number == len(pieces) - 1 else "open")
        reasoning += delta.reasoning
        content += delta.content
        for entry in delta.tool_calls:
            if "id" in entry:
                assert entry["type"] == "function" and entry["function"]["name"]
                assert entry["index"] == len(calls), "calls open in order"
                calls.append([entry["function"]["name"], ""])
            calls[entry["index"]][1] += entry["function"]["arguments"]
    named = tuple((name, arguments) for name, arguments in calls)
    return Parsed(reasoning=reasoning, content=content, calls=named)


def chunkings(text: str) -> Iterator[list[str]]:
    """The text in chunks of every size, then cut in two at every character boundary."""
    for size in range(1, max(len(text), 1) + 1):
        yield [text[at : at + size] for at in range(0, max(len(text), 1), size)]
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


def parse_every_way(make: MakeParser, text: str, end: TextEnd = "stop") -> Parsed:
    """The whole-text parse, after checking that every chunking streams to it."""
    expected = whole(make, text, end)
    for pieces in chunkings(text):
        assert streamed(make, pieces, end) == expected, [len(piece) for piece in pieces][:3]
    return expected


def pairs(arguments: str) -> Any:
    """Arguments JSON as nested (key, value) lists: key order and repeated keys count."""
    return json.loads(arguments, object_pairs_hook=list)


def same_arguments(arguments: str, expected: dict | str) -> bool:
    """`expected` as an object (order and repeats of keys compared), or as the exact text."""
    if isinstance(expected, str):
        return arguments == expected
    return pairs(arguments) == pairs(json.dumps(expected))


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """A recorded output and what it means. `name`: the peer's test that recorded it."""

    name: str
    text: str
    content: str = ""
    calls: tuple[tuple[str, dict | str], ...] = ()  # arguments as an object, or exact text
    reasoning: str = ""
    end: TextEnd = "stop"


def check(make: MakeParser, case: Case) -> Parsed:
    """`case` parsed whole and streamed at every chunking (equal), and as expected."""
    parsed = parse_every_way(make, case.text, case.end)
    assert parsed.reasoning == case.reasoning
    assert parsed.content == case.content
    assert [name for name, _ in parsed.calls] == [name for name, _ in case.calls]
    for (_, arguments), (_, expected) in zip(parsed.calls, case.calls, strict=True):
        assert same_arguments(arguments, expected), arguments
    return parsed


def tool(name: str, properties: dict[str, dict]) -> dict:
    """A request's function tool with these parameter schemas."""
    parameters = {"type": "object", "properties": properties}
    return {"type": "function", "function": {"name": name, "parameters": parameters}}
