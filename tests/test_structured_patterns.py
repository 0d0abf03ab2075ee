"""Patterns in lowered schemas (engine/structured_output/schema/patterns.py, regex.py): what
the grammar writes for a pattern is exactly what Python's `re` matches, and never a character
a JSON string escapes."""

from __future__ import annotations

import itertools
import json
import random
import re

import pytest
import xgrammar as xgr

from baton.engine.structured_output import check_structured_outputs
from baton.engine.structured_output.schema import regex as nodes
from baton.engine.structured_output.spec import json_schema_grammar
from tests.structured_walk import Walker
from tests.test_structured_lowering import admits
from tests.test_structured_spec import spec


@pytest.fixture(scope="module")
def compiler() -> xgr.GrammarCompiler:
    return Walker().compiler


def _random_regex(rng: random.Random, depth: int) -> nodes.Node:
    roll = rng.random()
    if depth == 0 or roll < 0.3:
        low, high = rng.choice([(97, 97), (98, 98), (77, 77), (97, 98)])
        return nodes.Chars(((low, high),))
    if roll < 0.55:
        return nodes.Seq(tuple(_random_regex(rng, depth - 1) for _ in range(rng.randint(2, 3))))
    if roll < 0.7:
        return nodes.Alt(tuple(_random_regex(rng, depth - 1) for _ in range(2)))
    low, high = rng.choice([0, 0, 1, 2]), rng.choice([None, 1, 2, 3])
    return nodes.Repeat(
        _random_regex(rng, depth - 1), low, high if high is None else max(low, high)
    )


def test_pattern_grammars_match_exactly_what_pythons_re_does(compiler):
    """Seeded random regexes over {a, b, M}: every string of up to 4 characters is written by
    the grammar exactly when `re.fullmatch` matches it (xgrammar's automaton, which the
    lowering steps around, fails this: "^(?:ba*)?$" writes "a")."""
    rng = random.Random(51)
    texts = ["".join(t) for n in range(5) for t in itertools.product("abM", repeat=n)]
    for _ in range(40):
        regex = nodes.regex_text(nodes.simplify(_random_regex(rng, 3)))
        assert nodes.regex_text(nodes.parse_regex(regex)) == regex
        grammar = json_schema_grammar(json.dumps({"type": "string", "pattern": regex}))
        compiled = compiler.compile_grammar(grammar)
        for text in texts:
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
            written = matcher.accept_string(json.dumps(text)) and matcher.is_completed()
            assert written == bool(re.fullmatch(regex, text)), (regex, text)


def test_a_pattern_never_writes_what_json_strings_escape(compiler):
    schema = {"type": "string", "pattern": "^[ -~]{3}$"}  # printable ASCII: a quote too
    assert admits(compiler, schema, '"a b"')
    for text in ('"a"b"', '"a\\b"', '"a\\"b"'):
        assert not admits(compiler, schema, text), text
    lowered = json.loads(check_structured_outputs(spec("json", {"pattern": "é[^a]"})).spec)
    assert lowered["pattern"].isascii()  # (non-ASCII text took another, unescaped, path)
    assert not admits(compiler, {"pattern": "^é[^a]$"}, '"é\x01"')
    assert admits(compiler, {"pattern": "^é[^a]$"}, '"éb"')
