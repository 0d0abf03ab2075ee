"""What every tool-call format shares: the answer is content with call blocks in it.

    text:  Let me check. <tool_call>{"name": "f", "arguments": {}}</tool_call> Done.
           └─ content ──┘└──────────────── block ────────────────────────┘└content┘
    parse: content "Let me check.  Done."   calls [f({})]

A block begins at one of the format's start tags; the format's block reader says whether what
follows really is a block (a tag the model only mentions is text), which calls it holds and where
it ends. Text outside blocks is content as written, except that a stretch of only whitespace next
to a block is the template's layout and dropped. A block that yields no call is content as
written, and so is the unreadable rest of one that did: nothing the model wrote is lost.

A parse is a function of the text so far and of how it ended, and returns only what can no
longer change: a suffix that may still become a start tag, whitespace that may still turn out to
frame a block, and a block not yet decided are held back. So the streamed answer is the
difference between successive parses, and the streamed pieces concatenate to exactly what one
parse of the whole text returns (tests/test_peer_*_cases.py check it at every chunking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Protocol

# How the text so far ends: "open" (more may come), "stop" (the model ended it: EOS, a stop
# string) or "length" (cut by max_tokens or the context). Only "length" excuses a call block
# left unfinished.
TextEnd = Literal["open", "stop", "length"]


def text_end(finished: bool, finish_reason: str | None) -> TextEnd:
    if not finished:
        return "open"
    return "length" if finish_reason == "length" else "stop"


@dataclass(frozen=True, kw_only=True, slots=True)
class ToolCallText:
    name: str
    arguments: str  # JSON text (a prefix of it while the call is still being written)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParsedContent:
    content: str
    calls: tuple[ToolCallText, ...]


class ToolCallParser(Protocol):
    def parse(self, text: str, end: TextEnd) -> ParsedContent: ...


def held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


# No function is named with whitespace, a tag or template braces in it: `bad\n</function`
# is a tag the model never closed, `{{ tc.name }}` an unrendered chat template it quoted.
_NOT_IN_NAMES = re.compile(r"[\s<>{}\"'`]")


def function_name(written: str) -> str | None:
    """The name a call gives, or None when `written` cannot name a function."""
    name = written.strip()
    return name if name and _NOT_IN_NAMES.search(name) is None else None


def cannot_become_name(partial: str) -> bool:
    """`partial`, a name still being written, already holds what no name holds."""
    return _NOT_IN_NAMES.search(partial.strip(" ")) is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class Block:
    calls: tuple[ToolCallText, ...]
    span: int  # characters after the start tag that the block covers (all of them while open)
    closed: bool  # the block has ended (at its end tag, or where a finished text ends)
    leftover: str  # unreadable text of a block that yielded calls, given back as content


class NotABlock:
    """The start tag is text: a mention, not a call."""


class Undecided:
    """What follows the start tag cannot tell yet whether it is a block."""


NOT_A_BLOCK, UNDECIDED = NotABlock(), Undecided()


class BlockReader(Protocol):
    def read(self, body: str, end: TextEnd) -> Block | NotABlock | Undecided:
        """`body`: the text after the start tag, to the end of the text so far."""
        ...


class TaggedBlocks:
    """Content and blocks. `reader_for(tag)` makes the reader of a block that starts with
    `tag`; readers are kept per start position, so a long streamed block is read once."""

    def __init__(self, starts: tuple[str, ...], reader_for) -> None:
        self.starts = starts
        self.reader_for = reader_for
        self.readers: dict[int, BlockReader] = {}
        self.closed: dict[int, Block] = {}  # blocks that ended: read once

    def parse(self, text: str, end: TextEnd) -> ParsedContent:
        content: list[str] = []
        calls: list[ToolCallText] = []
        position = search = 0  # position: where the current content segment begins
        after_block = False
        while True:
            start, tag = self._next_start(text, search)
            if start == -1:
                content.append(self._last_segment(text[position:], end, after_block))
                break
            read = self.closed.get(start) or self._read(text, start, tag, end)
            if isinstance(read, NotABlock):
                search = start + 1
                continue
            segment = text[position:start]
            if not segment.isspace():  # whitespace next to a block is layout
                content.append(segment)
            if isinstance(read, Undecided):
                break
            calls.extend(read.calls)
            body_start = start + len(tag)
            if not read.calls and read.closed:
                content.append(text[start : body_start + read.span])
            elif read.leftover:
                content.append(read.leftover)
            if not read.closed:
                break
            position = search = body_start + read.span
            after_block = True
        return ParsedContent(content="".join(content), calls=tuple(calls))

    def _read(self, text: str, start: int, tag: str, end: TextEnd) -> Block | NotABlock | Undecided:
        reader = self.readers.get(start)
        if reader is None:
            reader = self.readers[start] = self.reader_for(tag)
        read = reader.read(text[start + len(tag) :], end)
        if isinstance(read, Block) and read.closed:
            self.closed[start] = read
        return read

    def _next_start(self, text: str, search: int) -> tuple[int, str]:
        found = [(text.find(tag, search), tag) for tag in self.starts]
        found = [(at, tag) for at, tag in found if at != -1]
        return min(found) if found else (-1, "")

    def _last_segment(self, segment: str, end: TextEnd, after_block: bool) -> str:
        """The text after the last block (or all of it when there is none)."""
        if end == "open":  # it may still grow into a start tag, or turn out to frame one
            held = max(held_tag_prefix(segment, tag) for tag in self.starts)
            segment = segment[: len(segment) - held]
            return "" if segment.isspace() else segment
        if after_block and segment.isspace():
            return ""
        return segment
