"""The engine's cache of compiled grammars (engine/structured_output/compiled_cache.py): a spec
that comes again is compiled once, and the memory the cache holds stays within its limit.

xgrammar's own cache, given a limit, grew the process ~27 times past it over distinct schemas
(and clearing it gave little back): the memory test below measures the process itself."""

from __future__ import annotations

import gc
import json
import random

import pytest

from baton.engine.core.sampling_params import StructuredOutputs
from baton.engine.structured_output.compiled_cache import MEMORY_OVERHEAD, CompiledCache
from baton.engine.structured_output.spec import compile_structured
from tests.structured_walk import Walker


@pytest.fixture(scope="module")
def compiler():
    return Walker().compiler  # (xgrammar's cache off, as the engine's)


def distinct_schema(seed: int) -> StructuredOutputs:
    """An object of 20 typed properties, named for `seed` (already in lowered form)."""
    rng = random.Random(seed)
    properties = {
        f"f{seed}_{k}": {"type": rng.choice(["string", "integer", "boolean"])} for k in range(20)
    }
    schema = {"type": "object", "properties": properties, "required": list(properties)[:2]}
    return StructuredOutputs(kind="json", spec=json.dumps(schema), after_token_ids=())


def compile_through(cache: CompiledCache, compiler, structured: StructuredOutputs):
    return cache.get(
        (structured.kind, structured.spec), lambda: compile_structured(compiler, structured)
    )


def test_a_spec_that_comes_again_is_compiled_once_and_the_least_recent_leaves_first(compiler):
    compiled = []

    def counting(structured):
        def compile_grammar():
            compiled.append(structured.spec)
            return compile_structured(compiler, structured)

        return compile_grammar

    one = compile_structured(compiler, distinct_schema(0))
    cache = CompiledCache(limit_bytes=int(2.5 * one.memory_size_bytes * MEMORY_OVERHEAD))  # two
    a, b, c = (distinct_schema(seed) for seed in (0, 1, 2))
    for structured in (a, b, a, c, a, b):
        cache.get(structured.spec, counting(structured))
    # a b (a: held) c (evicts b, the least recent) (a: held) b (evicts c)
    assert compiled == [a.spec, b.spec, c.spec, b.spec]
    assert len(cache) == 2 and cache.held_bytes <= cache.limit_bytes
    larger = CompiledCache(limit_bytes=10)
    assert larger.get("x", lambda: one) is one and len(larger) == 0  # too large to keep


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_memory_stays_within_the_cache_limit_over_3000_distinct_schemas(compiler):
    """The process grows by no more than the cache limit and 10% while 3,000 distinct schemas
    pass through the cache. Accounting a grammar at xgrammar's reported size alone grows it
    ~1.4 times the limit; xgrammar's own cache, ~27 times."""
    limit = 16 << 20
    cache = CompiledCache(limit_bytes=limit)
    for seed in range(-100, 0):  # (allocator arenas and xgrammar's first compiles settle)
        compile_structured(compiler, distinct_schema(seed))
    gc.collect()
    before = _rss_bytes()
    for seed in range(3000):
        compile_through(cache, compiler, distinct_schema(seed))
    grown = _rss_bytes() - before
    assert cache.held_bytes <= limit
    assert grown <= 1.1 * limit, f"grew {grown / 2**20:.1f} MB for a {limit >> 20} MB cache"
