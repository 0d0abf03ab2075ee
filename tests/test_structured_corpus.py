"""Real-world JSON schemas through the structured-output check: 300 from JSONSchemaBench, a seeded
sample of its 10 subsets (tests/fixtures/jsonschemabench/SOURCES.md).

Refused: at most 5% of them, each for a keyword no grammar of the engine's can enforce (`not`
of an arbitrary schema, `uniqueItems`, oneOf options that may overlap, a `$ref` outside the
schema), named with its path. Accepted: the grammar the engine compiles for the lowered schema
admits nothing that breaks the schema as given. Outputs are drawn by walking the grammar's
matcher over a real byte-level tokenizer (tests/structured_walk.py) and checked with jsonschema
under the schema's own draft (`format` as an annotation, JSON Schema's default).

    python -m pytest -q tests/test_structured_corpus.py -s   # prints the refusals and reasons
"""

from __future__ import annotations

import collections
import functools
import gzip
import json
import re
from pathlib import Path

import pytest

from baton.engine.core.sampling_params import StructuredOutputs
from baton.engine.structured_output import check_structured_outputs
from baton.engine.structured_output.schema import validator_class
from baton.engine.structured_output.spec import JSON_OPTIONS, compile_structured
from tests.structured_walk import Walker

FIXTURE = Path(__file__).parent / "fixtures" / "jsonschemabench" / "sample.jsonl.gz"
MAX_REFUSED = 0.05
WALKS = 3  # outputs drawn per accepted schema
# what the engine refuses because no grammar of its own enforces it, as the refusals say it
UNENFORCEABLE = {
    "not": "'not' is not enforced",
    "uniqueItems": "'uniqueItems' is not enforced",
    "overlapping oneOf": "its options may match the same values",
    "$ref outside the schema": "points outside this schema",
    # (as uniqueItems: distinct extra keys, which a grammar cannot keep apart)
    "minProperties over extra keys": "extra keys are not kept apart",
}


@functools.cache
def corpus() -> dict[str, object]:
    with gzip.open(FIXTURE, "rt", encoding="utf-8") as lines:
        return {entry["id"]: entry["schema"] for entry in map(json.loads, lines)}


@functools.cache
def checked() -> dict[str, StructuredOutputs | str]:
    """Each schema's checked spec, or the refusal's message."""
    results: dict[str, StructuredOutputs | str] = {}
    for name, schema in corpus().items():
        structured = StructuredOutputs(kind="json", spec=json.dumps(schema), after_token_ids=())
        try:
            results[name] = check_structured_outputs(structured)
        except ValueError as error:
            results[name] = str(error)
    return results


@pytest.fixture(scope="module")
def walker() -> Walker:
    return Walker()


def test_few_corpus_schemas_are_refused_each_naming_an_unenforceable_keyword_and_its_path():
    refused = {name: result for name, result in checked().items() if isinstance(result, str)}
    reasons = collections.Counter(
        next((reason for reason, said in UNENFORCEABLE.items() if said in m), m)
        for m in refused.values()
    )
    print(f"\nrefused {len(refused)} of {len(corpus())}: {dict(reasons)}")
    for name, message in sorted(refused.items()):
        print(f"  {name}: {message}")
    assert len(refused) <= MAX_REFUSED * len(corpus()), reasons
    for name, message in refused.items():
        assert re.match(r"structured_outputs: JSON schema at /\S*: ", message), (name, message)
        assert any(said in message for said in UNENFORCEABLE.values()), (name, message)


def test_every_output_an_accepted_corpus_schema_admits_meets_it(walker):
    broken, written, unfinished = [], 0, []
    for name, structured in checked().items():
        if isinstance(structured, str):
            continue
        schema = corpus()[name]
        validator = validator_class(schema)(schema)
        compiled = compile_structured(walker.compiler, structured)
        texts = [walker.walk(compiled, seed) for seed in range(WALKS)]
        if not any(texts):
            unfinished.append(name)  # (its strings need a suffix a random walk rarely writes)
        for text in filter(None, texts):
            written += 1
            problem = _problem(validator, text)
            if problem is not None:
                broken.append((name, problem, text[:300]))
    accepted = sum(not isinstance(result, str) for result in checked().values())
    print(f"\n{written} outputs of {accepted} schemas; no output drawn for {unfinished}")
    assert not broken, broken
    assert len(unfinished) <= 0.05 * accepted, unfinished


def _problem(validator, text: str) -> str | None:
    """Why `text` is not a JSON value the schema allows, or None."""
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError as error:
        return f"not JSON: {error}"
    error = next(validator.iter_errors(value), None)
    return None if error is None else f"{error.json_path}: {error.message[:200]}"


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def test_the_walk_finds_what_xgrammar_alone_lets_through(walker):
    """The check above can fail: the issue's unsound schemas, compiled by xgrammar as they are
    (before lowering), write outputs the schema refuses, and the walk finds them."""
    cases = [
        {"type": "integer", "minimum": 0, "multipleOf": 12},  # multipleOf dropped
        {
            "type": "object",
            "properties": {"s": {"type": "string", "maxLength": 4}},
            "required": ["s"],
        },
    ]
    for schema in cases:
        compiled = walker.compiler.compile_json_schema(json.dumps(schema), **JSON_OPTIONS)
        validator = validator_class(schema)(schema)
        texts = filter(None, (walker.walk(compiled, seed) for seed in range(40)))
        assert any(_problem(validator, text) for text in texts), schema
