"""A JSON Schema `pattern` as a regex the grammar engine turns into JSON-safe strings.

A schema's pattern is searched for (JSON Schema's semantics, and Python's `re.search`, which
jsonschema validates with); the grammar engine writes a string its regex matches whole, one
code point per character match, between the quotes and without escapes. Three gaps follow
(each measured on xgrammar 0.2.9), and `json_string_regex` closes them:

* a quote, a backslash or a control character the regex admits is written raw (a literal `"`,
  or any character of a pattern that is not printable ASCII, which xgrammar compiles another
  way): the output is no longer JSON. Here every character match is a class of code points
  without those characters (a pattern that needs one has no output the engine can write);
* lookarounds are dropped silently ("(?!x)" matches "x"), `\\b`, `\\p{..}` and flags fail:
  refused here, naming the construct;
* classes and shorthands differ between dialects (Python's `\\d` is every Unicode digit,
  ECMA 262's, JSON Schema's own, the ASCII ones): each is written as explicit code point
  ranges, never wider than either (`\\w` and `\\W` narrowed to ASCII, `.` and `\\s` to what
  both take).

Parsing is Python's (re._parser), so a pattern means what the validator reads. The result is
what the grammar engine matches whole: an unanchored pattern gets `.*` on its
open side (search semantics). `bounded` narrows a pattern's language to the lengths a
minLength / maxLength allow (the grammar engine reads only one of pattern and lengths).
"""

from __future__ import annotations

import functools
import math
import re
import re._constants as sre
import re._parser as sre_parse
import warnings

from baton.engine.structured_output.schema.regex import (
    EMPTY,
    EPSILON,
    MAX_CODE_POINT,
    UNIVERSE,
    UNSAFE,
    Alt,
    Anchor,
    Chars,
    Node,
    Ranges,
    Repeat,
    Seq,
    length_range,
    minus,
    normal,
    regex_text,
    simplify,
)

# A count this high makes the grammar engine's automaton (and its token masks) huge: a length
# bound narrows a repetition to at most this many (sound: fewer characters, still in range).
MAX_DERIVED_REPEAT = 256


class PatternError(ValueError):
    """A pattern the grammar engine cannot enforce (the message names the construct)."""


# -- code point sets ---------------------------------------------------------------------------


def _runs(predicate) -> Ranges:
    found, start = [], None
    for point in range(MAX_CODE_POINT + 2):
        inside = point <= MAX_CODE_POINT and predicate(chr(point))
        if inside and start is None:
            start = point
        elif not inside and start is not None:
            found.append((start, point - 1))
            start = None
    return tuple(found)


_ASCII = ((0, 0x7F),)
_ECMA_ONLY_SPACES = ((0xFEFF, 0xFEFF),)
_PYTHON_ONLY_SPACES = ((0x1C, 0x1F), (0x85, 0x85))
# ECMA's `.` leaves out U+2028 and U+2029 (line terminators) besides what Python's does
_DOT = minus(UNIVERSE, ((0x2028, 0x2029),))
_ASCII_WORD = normal([(0x30, 0x39), (0x41, 0x5A), (0x61, 0x7A), (0x5F, 0x5F)])


@functools.cache
def _digits() -> Ranges:  # Python's \d: str.isdecimal (exact)
    return _runs(str.isdecimal)


@functools.cache
def _spaces(widest: bool) -> Ranges:
    """Python's \\s (str.isspace) and ECMA 262's (JSON Schema's dialect): both (widest), or
    what both take (Python's has U+0085 and U+001C-1F, ECMA's U+FEFF)."""
    python = _runs(str.isspace)
    return normal(python + _ECMA_ONLY_SPACES) if widest else minus(python, _PYTHON_ONLY_SPACES)


def _category(category, widest: bool) -> Ranges:
    """The category's code points: a subset of Python's and ECMA's (or, `widest`, a superset
    of both), so a class never admits more than either dialect's and a negated class never
    excludes less."""
    if category in (sre.CATEGORY_DIGIT, sre.CATEGORY_UNI_DIGIT):
        return _digits() if widest else ((0x30, 0x39),)
    if category in (sre.CATEGORY_NOT_DIGIT, sre.CATEGORY_UNI_NOT_DIGIT):
        return minus(UNIVERSE, _digits())
    if category in (sre.CATEGORY_SPACE, sre.CATEGORY_UNI_SPACE):
        return _spaces(widest)
    if category in (sre.CATEGORY_NOT_SPACE, sre.CATEGORY_UNI_NOT_SPACE):
        return minus(UNIVERSE, _spaces(not widest))
    non_ascii = minus(((0, MAX_CODE_POINT),), _ASCII)
    if category in (sre.CATEGORY_WORD, sre.CATEGORY_UNI_WORD):  # Unicode letters: too many
        return normal(_ASCII_WORD + non_ascii) if widest else _ASCII_WORD
    if category in (sre.CATEGORY_NOT_WORD, sre.CATEGORY_UNI_NOT_WORD):
        ascii_other = minus(_ASCII, _ASCII_WORD)
        return normal(ascii_other + non_ascii) if widest else ascii_other
    raise PatternError(f"the character category {category} is not supported")


def _class(items) -> Ranges:
    negate = bool(items) and items[0][0] is sre.NEGATE
    found = []
    for op, value in items[1:] if negate else items:
        if op is sre.LITERAL:
            found.append((value, value))
        elif op is sre.RANGE:
            found.append(value)
        elif op is sre.CATEGORY:
            found.extend(_category(value, widest=negate))
        else:
            raise PatternError(f"the class item {op} is not supported")
    found = normal(found)
    return minus(UNIVERSE, found) if negate else minus(found, UNSAFE)


# -- Python's parse -> nodes ---------------------------------------------------------------------

_ALLOWED_FLAGS = re.UNICODE | re.VERBOSE | re.ASCII


def parse(pattern: str) -> Node:
    """The pattern as nodes (PatternError for what the grammar engine cannot enforce)."""
    try:
        with warnings.catch_warnings():  # (FutureWarning: "possible nested set" and the like)
            warnings.simplefilter("ignore")
            parsed = sre_parse.parse(pattern)
    except re.error as error:
        raise PatternError(f"is not a valid regular expression: {error}") from None
    if parsed.state.flags & ~_ALLOWED_FLAGS:
        raise PatternError("uses inline flags such as (?i), which are not supported")
    return _node(parsed)


def _node(items) -> Node:
    return simplify(Seq(tuple(_item(op, value) for op, value in items)))


def _item(op, value) -> Node:
    if op is sre.LITERAL:
        return Chars(minus(((value, value),), UNSAFE))
    if op is sre.NOT_LITERAL:
        return Chars(minus(UNIVERSE, ((value, value),)))
    if op is sre.ANY:
        return Chars(_DOT)
    if op is sre.IN:
        return Chars(_class(value))
    if op is sre.BRANCH:
        return Alt(tuple(_node(option) for option in value[1]))
    if op is sre.SUBPATTERN:
        _, add_flags, del_flags, inner = value
        if (add_flags | del_flags) & ~_ALLOWED_FLAGS:
            raise PatternError("uses inline flags such as (?i:...), which are not supported")
        return _node(inner)
    if op is sre.ATOMIC_GROUP:
        return _node(value)
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # lazy or greedy: the same language
        low, high, inner = value
        return Repeat(_node(inner), low, None if high is sre.MAXREPEAT else high)
    if op is sre.AT:
        if value in (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING):
            return Anchor(start=True)
        if value in (sre.AT_END, sre.AT_END_STRING):
            return Anchor(start=False)
        raise PatternError("uses a word boundary (\\b or \\B), which is not supported")
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        raise PatternError("uses a lookahead or lookbehind, which is not supported")
    if op in (sre.GROUPREF, sre.GROUPREF_EXISTS):
        raise PatternError("uses a backreference, which is not supported")
    raise PatternError(f"uses {str(op).lower()}, which is not supported")


# -- search semantics -> a whole match -------------------------------------------------------------


def _has_anchor(node: Node) -> bool:
    if isinstance(node, Anchor):
        return True
    if isinstance(node, Seq):
        return any(map(_has_anchor, node.items))
    if isinstance(node, Alt):
        return any(map(_has_anchor, node.options))
    return isinstance(node, Repeat) and _has_anchor(node.node)


def whole_match(node: Node) -> Node:
    """A node whose whole matches are strings the original is found in (re.search): anchors
    resolved, `.*` on an unanchored side. Alternatives holding anchors are distributed."""
    node = simplify(node)
    if isinstance(node, Alt):
        return simplify(Alt(tuple(whole_match(option) for option in node.options)))
    items = list(node.items) if isinstance(node, Seq) else [node]
    for index, item in enumerate(items):
        if isinstance(item, Alt) and _has_anchor(item):
            return whole_match(
                Alt(tuple(Seq((*items[:index], o, *items[index + 1 :])) for o in item.options))
            )
        if isinstance(item, Repeat) and _has_anchor(item):
            raise PatternError("repeats an anchor (^ or $), which is not supported")
    starts = isinstance(items[0], Anchor) and items[0].start if items else False
    ends = isinstance(items[-1], Anchor) and not items[-1].start if items else False
    body = items[1 if starts else 0 : len(items) - 1 if ends else len(items)]
    if any(isinstance(item, Anchor) for item in body):
        return EMPTY  # "a^b" or "a$b": no string has a start or an end there
    anything = Repeat(Chars(UNIVERSE), 0, None)
    return simplify(Seq(((), (anything,))[not starts] + tuple(body) + ((), (anything,))[not ends]))


# -- lengths -----------------------------------------------------------------------------------


def bounded(node: Node, low: int, high: float) -> Node | None:
    """A node whose language is part of `node`'s, every string `low`..`high` characters long
    (None when no such narrowing is found). Counts it has to bound stay under
    MAX_DERIVED_REPEAT where the lengths allow."""
    least, most = length_range(node)
    if least >= low and most <= high:
        return node
    if least > high or most < low:
        return None
    if isinstance(node, Alt):
        options = [o for o in (bounded(option, low, high) for option in node.options) if o]
        return simplify(Alt(tuple(options))) if options else None
    if isinstance(node, Seq):
        return _bounded_seq(node, low, high)
    if isinstance(node, Repeat):
        return _bounded_repeat(node, low, high)
    return None


def _bounded_seq(node: Seq, low: int, high: float) -> Node | None:
    """Each item gets a window of lengths: an equal share of the room first, else each
    variable item in turn takes all of it (the others at their least)."""
    ranges = [length_range(item) for item in node.items]
    found = _windowed(node, ranges, low, high, shared=True)
    variable = [i for i, (least, most) in enumerate(ranges) if most > least]
    for taker in variable if found is None else []:
        found = _windowed(node, ranges, low, high, shared=False, taker=taker)
        if found is not None:
            break
    return found


def _windowed(node: Seq, ranges, low: int, high: float, shared: bool, taker: int = -1):
    floor = sum(r[0] for r in ranges)
    windows = [[least, most] for least, most in ranges]
    variable = [i for i, (least, most) in enumerate(ranges) if most > least]
    if not shared:  # one item takes the room, the others keep to their least
        variable = [taker]
        for i, (least, _) in enumerate(ranges):
            if i != taker:
                windows[i][1] = least
    if high < math.inf:  # each variable item: its minimum plus an equal share of the room
        room = min(high, max(low, floor + MAX_DERIVED_REPEAT)) - floor
        for rank, i in enumerate(variable):
            share = room // len(variable) + (1 if rank < room % len(variable) else 0)
            windows[i][1] = min(ranges[i][1], ranges[i][0] + share)
    deficit = low - floor
    for i in variable:  # the minimum length: raise lower ends where there is room
        raise_by = max(0, min(deficit, windows[i][1] - windows[i][0]))
        windows[i][0] += raise_by
        deficit -= raise_by
    if deficit > 0:
        return None
    items = []
    for item, (item_low, item_high) in zip(node.items, windows):
        narrowed = bounded(item, item_low, item_high)
        if narrowed is None:
            return None
        items.append(narrowed)
    return simplify(Seq(tuple(items)))


def _bounded_repeat(node: Repeat, low: int, high: float) -> Node | None:
    least, most = length_range(node.node)
    if least == most:  # a fixed length: bound the count alone
        return _counted(node, node.node, low, high)
    # any length per repetition (counted by the extremes), else one fixed length per repetition
    for each_low, each_high in [(max(least, 1), min(most, high))] + [
        (k, k) for k in range(max(least, 1), int(min(most, high, 8)) + 1)
    ]:
        inner = bounded(node.node, each_low, each_high)
        if inner is not None:
            found = _counted(node, inner, low, high)
            if found is not None:
                return found
    return None


def _counted(node: Repeat, inner: Node, low: int, high: float) -> Node | None:
    """`inner` repeated within node's counts so the total is low..high (None: no count fits)."""
    each_low, each_high = length_range(inner)
    if each_high == 0:
        return Repeat(inner, node.low, node.high) if low == 0 else None
    count_low = max(node.low, math.ceil(low / max(each_low, 1)))
    count_high = math.inf if node.high is None else node.high
    if high < math.inf:
        count_high = min(count_high, high // each_high, max(count_low, MAX_DERIVED_REPEAT))
    if count_low > count_high or (each_low == 0 and low > 0):
        return None
    return Repeat(inner, count_low, None if count_high == math.inf else int(count_high))


# -- nodes -> the grammar engine's regex ------------------------------------------------------------


def excluding_regex(names: set[str], min_length: int = 0, max_length: float = math.inf) -> str:
    """A regex matching every JSON-safe string but `names` (a trie, complemented), of these
    lengths (PatternError when none is left)."""

    def node(words: set[str]) -> Node:
        firsts = {word[0] for word in words if word}
        options: list[Node] = [] if "" in words else [EPSILON]
        others = minus(UNIVERSE, normal((ord(c), ord(c)) for c in firsts))
        if others:
            options.append(Seq((Chars(others), Repeat(Chars(UNIVERSE), 0, None))))
        for first in sorted(firsts):
            rest = {word[1:] for word in words if word[:1] == first}
            options.append(Seq((Chars(((ord(first), ord(first)),)), node(rest))))
        return simplify(Alt(tuple(options)))

    narrowed = bounded(node(set(names)), min_length, max_length)
    if narrowed is None:
        raise PatternError(f"leaves no string of {min_length} to {max_length} characters")
    return regex_text(narrowed)


def json_string_regex(pattern: str, min_length: int = 0, max_length: float = math.inf) -> str:
    """The regex the grammar engine matches whole for a string with this `pattern` (searched
    for, as JSON Schema does) and these lengths: every string it matches needs no escape in
    JSON and meets all three. PatternError says what cannot be enforced."""
    node = whole_match(parse(pattern))
    if node == EMPTY:
        raise PatternError(
            "matches no string the grammar engine can write (an anchor ^ or $ inside it, or "
            "only strings with a quote, a backslash or a control character)"
        )
    narrowed = bounded(node, min_length, max_length)
    if narrowed is None:
        raise PatternError(
            f"has no match of {min_length} to {max_length} characters the grammar engine can write"
        )
    return regex_text(narrowed)
