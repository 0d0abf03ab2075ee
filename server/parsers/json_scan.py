"""An incremental JSON reader for tool-call arguments: feed it the model's text as it grows, and
it writes the value out again with standard spacing, only ever appending.

    raw:        {"city":"Par          {"city":"Paris","days":3}
    canonical:  {"city": "Par         {"city": "Paris", "days": 3}

The canonical text is json.dumps' layout (", " and ": ", no other whitespace) with strings and
numbers kept as the model wrote them, so a streamed value is exactly the concatenation of what
was emitted along the way: characters of a string go out as they arrive; a number or a literal
(true, false, null) waits for the character that ends it, since "1" may still become "12".
Raw control characters inside strings (invalid JSON) are escaped, so a finished value always
parses. Iterative, not recursive: a model may open thousands of brackets.

For tool calls it also records where the values of chosen keys sit in the canonical text
("name", "arguments"), for the top-level object or for each object of a top-level array.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_WHITESPACE = frozenset(" \t\r\n")
_CONTROL_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\b": "\\b", "\f": "\\f"}


@dataclass(kw_only=True, slots=True)
class _Frame:
    kind: str  # "{" or "["
    state: str  # object: key, colon, value, next; array: value, next
    key: str | None = None  # object: the key whose value is read now
    items: int = 0  # array: index of the element read now
    empty: bool = True  # nothing read yet: "}" / "]" may close it


@dataclass(kw_only=True, slots=True)
class JsonScanner:
    """Feed text with `feed`; read `canonical` (final so far), `done`, `error`.

    `tracked`: keys whose values' spans in `canonical` are recorded in `spans`, keyed by
    (element index or None for a top-level object, key)."""

    tracked: frozenset[str]
    done: bool = False  # the top-level value is complete
    error: bool = False  # the text stopped being JSON; nothing more is read
    consumed: int = 0  # characters of the input read (the value ends here once done)
    spans: dict[tuple[int | None, str], list[int | None]] = field(default_factory=dict)
    # tracked objects now closed -> characters of the input read up to and with their "}"
    ended_items: dict[int | None, int] = field(default_factory=dict)
    _stack: list[_Frame] = field(default_factory=list)
    # The canonical text, in pieces (appending to one long str copies it every character)
    _pieces: list[str] = field(default_factory=list)
    _length: int = 0
    _joined: str = ""  # "".join(_pieces) as of the last read
    _pending: str = ""  # a number or literal not yet ended
    _in_string: bool = False
    _string_raw: str = ""  # the string being read, as written (for keys)
    _escape: bool = False
    _string_is_key: bool = False

    def feed(self, text: str) -> None:
        for char in text:
            if self.done or self.error:
                return
            self._step(char)
            if not self.error:
                self.consumed += 1

    @property
    def canonical(self) -> str:
        """The value so far, only what can no longer change."""
        if len(self._joined) != self._length:
            self._joined = "".join(self._pieces)
            self._pieces = [self._joined]
        return self._joined

    def finished_canonical(self) -> str:
        """`canonical` as it stands once the text has ended: a number or literal still pending
        counts when it is whole."""
        if self._pending and self._pending_complete():
            return self.canonical + self._pending
        return self.canonical

    def _emit(self, text: str) -> None:
        self._pieces.append(text)
        self._length += len(text)

    def _pending_complete(self) -> bool:
        return self._pending in _LITERALS or _NUMBER.fullmatch(self._pending) is not None

    def _where(self) -> int | None | bool:
        """The element index of the object on top of the stack when it is tracked: None for
        the top-level object, k for an object that is element k of a top-level array; False
        for any other depth."""
        if len(self._stack) == 1 and self._stack[0].kind == "{":
            return None
        if len(self._stack) == 2 and self._stack[0].kind == "[" and self._stack[1].kind == "{":
            return self._stack[0].items
        return False

    def _step(self, char: str) -> None:
        if self._in_string:
            self._string_char(char)
            return
        if self._pending:
            if char in _NUMBER_CHARS or char.isalpha():
                self._pending += char
                if not self._pending_may_grow():
                    self.error = True
                return
            if not self._pending_complete():
                self.error = True
                return
            self._emit(self._pending)
            self._pending = ""
            self._value_done()
            if self.done:
                return
        if char in _WHITESPACE:
            return
        frame = self._stack[-1] if self._stack else None
        if frame is None or frame.state == "value":
            self._value_start(char, frame)
        elif frame.state == "key":
            if char == '"':
                self._open_string(is_key=True)
            elif char == "}" and frame.empty:
                self._close()
            else:
                self.error = True
        elif frame.state == "colon":
            if char == ":":
                self._emit(": ")
                frame.state = "value"
                where = self._where()
                if where is not False and frame.key in self.tracked:
                    self.spans[(where, frame.key)] = [self._length, None]
            else:
                self.error = True
        elif frame.state == "next":
            if char == ",":
                self._emit(", ")
                if frame.kind == "{":
                    frame.state = "key"
                else:
                    frame.state = "value"
                    frame.items += 1
            elif char == ("}" if frame.kind == "{" else "]"):
                self._close()
            else:
                self.error = True

    def _value_start(self, char: str, frame: _Frame | None) -> None:
        if char == "{" or char == "[":
            self._emit(char)
            self._stack.append(_Frame(kind=char, state="key" if char == "{" else "value"))
        elif char == '"':
            self._open_string(is_key=False)
        elif char == "-" or char.isdigit() or char in "tfn":
            self._pending = char
        elif char == "]" and frame is not None and frame.kind == "[" and frame.empty:
            self._close()
        else:
            self.error = True

    def _pending_may_grow(self) -> bool:
        if self._pending[0] in "tfn":
            return any(literal.startswith(self._pending) for literal in _LITERALS)
        return all(char in _NUMBER_CHARS for char in self._pending)

    def _open_string(self, *, is_key: bool) -> None:
        self._in_string = True
        self._string_is_key = is_key
        self._string_raw = '"'
        self._emit('"')

    def _string_char(self, char: str) -> None:
        self._string_raw += char
        if self._escape:
            self._escape = False
        elif char == "\\":
            self._escape = True
        elif char == '"':
            self._in_string = False
            self._emit('"')
            if self._string_is_key:
                frame = self._stack[-1]
                frame.key = _decode_key(self._string_raw)
                frame.state = "colon"
                frame.empty = False
            else:
                self._value_done()
            return
        self._emit(_CONTROL_ESCAPES.get(char, char) if ord(char) < 0x20 else char)

    def _close(self) -> None:
        frame = self._stack[-1]
        where = self._where() if frame.kind == "{" else False
        self._emit("}" if frame.kind == "{" else "]")
        self._stack.pop()
        if where is not False:
            self.ended_items[where] = self.consumed + 1  # `consumed` counts up after the step
        self._value_done()

    def _value_done(self) -> None:
        """A value just ended: its container moves on (or the whole value is done)."""
        if not self._stack:
            self.done = True
            return
        frame = self._stack[-1]
        frame.empty = False
        if frame.kind == "{":
            where = self._where()
            span = self.spans.get((where, frame.key)) if where is not False else None
            if span is not None and span[1] is None:
                span[1] = self._length
        frame.state = "next"


def _decode_key(raw: str) -> str:
    try:
        return json.loads(raw)
    except ValueError:
        return raw[1:-1]


def decode_string(canonical_value: str) -> str | None:
    """A JSON string value as text, or None when the value is not a whole string."""
    if len(canonical_value) < 2 or canonical_value[0] != '"' or canonical_value[-1] != '"':
        return None
    try:
        value = json.loads(canonical_value)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
