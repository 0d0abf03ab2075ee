"""The regexes this server writes for string patterns: their nodes, their text, and the
grammar (EBNF) they stand for.

Every character match is a class of code points (Chars) without a quote, a backslash or a
control character, so every string a regex here matches needs no escape in JSON. The text
(`regex_text`) is what a lowered schema holds: printable ASCII, in the syntax of Python's `re`
and of ECMA 262 alike (\\uXXXX, \\UXXXXXXXX escapes). The grammar (`regex_ebnf`) is what the engine compiles it into: xgrammar's own
automaton for a pattern admits strings the regex does not (0.2.9: "^(?:ba*)?$" writes "a",
"^(?:M|M{1,3})$" writes "MMMM"), its expansion into rules does not; `regex_ebnf` writes that
expansion from the nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_CODE_POINT = 0x10FFFF
Ranges = tuple[tuple[int, int], ...]
# Characters a JSON string needs escaped: never written by a pattern.
UNSAFE = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0xD800, 0xDFFF))


@dataclass(frozen=True)
class Chars:
    ranges: Ranges  # one code point from these (sorted, disjoint, JSON-safe)


@dataclass(frozen=True)
class Seq:
    items: tuple[Node, ...]


@dataclass(frozen=True)
class Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True)
class Repeat:
    node: Node
    low: int
    high: int | None  # None: unbounded


@dataclass(frozen=True)
class Anchor:
    start: bool  # ^ (else $)


Node = Chars | Seq | Alt | Repeat | Anchor
EMPTY = Alt(())  # matches nothing
EPSILON = Seq(())  # matches ""


# -- code point sets ------------------------------------------------------------------------------


def normal(ranges) -> Ranges:
    merged: list[list[int]] = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], high)
        else:
            merged.append([low, high])
    return tuple((low, high) for low, high in merged)


def minus(ranges: Ranges, removed: Ranges) -> Ranges:
    out = []
    for low, high in ranges:
        for cut_low, cut_high in removed:
            if cut_high < low or cut_low > high:
                continue
            if cut_low > low:
                out.append((low, cut_low - 1))
            low = cut_high + 1
            if low > high:
                break
        if low <= high:
            out.append((low, high))
    return normal(out)


UNIVERSE = minus(((0, MAX_CODE_POINT),), UNSAFE)


def simplify(node: Node) -> Node:
    """Empty classes make their sequence empty; empty options drop out."""
    if isinstance(node, Chars):
        return EMPTY if not node.ranges else node
    if isinstance(node, Seq):
        items = []
        for item in map(simplify, node.items):
            if item == EMPTY:
                return EMPTY
            items.extend(item.items if isinstance(item, Seq) else [item])
        return items[0] if len(items) == 1 else Seq(tuple(items))
    if isinstance(node, Alt):
        options = tuple(dict.fromkeys(o for o in map(simplify, node.options) if o != EMPTY))
        return options[0] if len(options) == 1 else Alt(options)
    if isinstance(node, Repeat):
        inner = simplify(node.node)
        if inner == EMPTY or node.high == 0:
            return EPSILON if node.low == 0 else EMPTY
        return Repeat(inner, node.low, node.high)
    return node


def length_range(node: Node) -> tuple[int, float]:
    if isinstance(node, Chars):
        return 1, 1
    if isinstance(node, Seq):
        ranges = [length_range(item) for item in node.items]
        return sum(r[0] for r in ranges), sum(r[1] for r in ranges)
    if isinstance(node, Alt):
        ranges = [length_range(option) for option in node.options]
        return min(r[0] for r in ranges), max(r[1] for r in ranges)
    if isinstance(node, Repeat):
        low, high = length_range(node.node)
        count = math.inf if node.high is None else node.high
        return node.low * low, high * count if high else 0
    return 0, 0


# -- nodes -> text -> nodes -> grammar ----------------------------------------------------------


def _char(point: int) -> str:
    char = chr(point)
    if char.isascii() and char.isalnum():
        return char
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"


def to_regex(node: Node) -> str:
    if isinstance(node, Chars):
        if len(node.ranges) == 1 and node.ranges[0][0] == node.ranges[0][1]:
            return _char(node.ranges[0][0])
        parts = (
            _char(low) if low == high else f"{_char(low)}-{_char(high)}"
            for low, high in node.ranges
        )
        return "[" + "".join(parts) + "]"
    if isinstance(node, Seq):
        return "".join(
            f"(?:{to_regex(item)})" if isinstance(item, Alt) else to_regex(item)
            for item in node.items
        )
    if isinstance(node, Alt):
        return "|".join(map(to_regex, node.options))
    if isinstance(node, Repeat):
        inner = to_regex(node.node)
        if not isinstance(node.node, Chars):
            inner = f"(?:{inner})"
        low, high = node.low, node.high
        quantifier = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((low, high))
        if quantifier is None:
            quantifier = f"{{{low},}}" if high is None else f"{{{low},{high}}}"
            quantifier = f"{{{low}}}" if low == high else quantifier
        return inner + quantifier
    raise AssertionError(node)


def regex_text(node: Node) -> str:
    """The whole-match regex of `node`, as a lowered schema holds it."""
    body = to_regex(node)
    return f"^(?:{body})$" if isinstance(node, Alt) else f"^{body}$"


def parse_regex(text: str) -> Node:
    """The nodes of a regex `regex_text` wrote (ValueError for any other text)."""
    if not (text.startswith("^") and text.endswith("$")):
        raise ValueError(f"not a regex of this server: {text!r}")
    reader = _Reader(text[1:-1])
    node = reader.alternatives()
    if reader.at < len(reader.text):
        raise ValueError(f"not a regex of this server: {text!r}")
    return node


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.at = text, 0

    def peek(self) -> str:
        return self.text[self.at : self.at + 1]

    def take(self, expected: str | None = None) -> str:
        char = self.peek()
        if not char or (expected is not None and char != expected):
            raise ValueError(f"unexpected {char!r} at {self.at} in {self.text!r}")
        self.at += 1
        return char

    def alternatives(self) -> Node:
        options = [self.sequence()]
        while self.peek() == "|":
            self.take()
            options.append(self.sequence())
        return options[0] if len(options) == 1 else Alt(tuple(options))

    def sequence(self) -> Node:
        items = []
        while self.peek() not in ("", "|", ")"):
            items.append(self.quantified(self.atom()))
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def atom(self) -> Node:
        char = self.take()
        if char == "(":
            for expected in "?:":
                self.take(expected)
            node = self.alternatives()
            self.take(")")
            return node
        if char == "[":
            ranges = []
            while self.peek() != "]":
                low = self.point()
                high = low
                if self.peek() == "-":
                    self.take()
                    high = self.point()
                ranges.append((low, high))
            self.take("]")
            return Chars(tuple(ranges))
        self.at -= 1
        point = self.point()
        return Chars(((point, point),))

    def point(self) -> int:
        char = self.take()
        if char != "\\":
            return ord(char)
        width = 4 if self.take() == "u" else 8
        self.at += width
        return int(self.text[self.at - width : self.at], 16)

    def quantified(self, node: Node) -> Node:
        char = self.peek()
        if char in ("*", "+", "?"):
            self.take()
            return Repeat(node, 1 if char == "+" else 0, 1 if char == "?" else None)
        if char != "{":
            return node
        end = self.text.index("}", self.at)
        low, comma, high = self.text[self.at + 1 : end].partition(",")
        self.at = end + 1
        return Repeat(node, int(low), int(low) if not comma else int(high) if high else None)


def regex_ebnf(node: Node) -> str:
    """The EBNF expression for `node`'s whole matches (xgrammar's syntax)."""
    if isinstance(node, Chars):
        return (
            "["
            + "".join(
                _ebnf_point(low) if low == high else f"{_ebnf_point(low)}-{_ebnf_point(high)}"
                for low, high in node.ranges
            )
            + "]"
        )
    if isinstance(node, Seq):
        return "(" + " ".join(map(regex_ebnf, node.items)) + ")" if node.items else '""'
    if isinstance(node, Alt):
        return "(" + " | ".join(map(regex_ebnf, node.options)) + ")"
    if isinstance(node, Repeat):
        inner = regex_ebnf(node.node)
        if isinstance(node.node, Repeat):  # (a quantifier takes one element)
            inner = f"({inner})"
        if (node.low, node.high) in ((0, None), (1, None), (0, 1)):
            return inner + {(0, None): "*", (1, None): "+", (0, 1): "?"}[(node.low, node.high)]
        return f"{inner}{{{node.low},{'' if node.high is None else node.high}}}"
    raise AssertionError(node)


def _ebnf_point(point: int) -> str:
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"
