"""What a StructuredOutputs may hold, checked before anything runs, and how it becomes a grammar.

`check_structured_outputs` is the whole check (ValueError naming the problem): the server runs it
in a worker thread before a request reaches its engine, the offline `LLM` before it adds one.
It parses the spec with xgrammar (a syntax error in a schema, regex or grammar is found here) and
refuses every JSON Schema keyword the grammar engine would not enforce (xgrammar only logs a
warning and drops them: an output "valid under the grammar" would then break the schema).
`compile_structured` is what the engine's compile thread runs (engine/structured_output.py).
"""

from __future__ import annotations

import functools
import json
from types import ModuleType
from typing import TYPE_CHECKING, Any

from baton.engine.core.sampling_params import StructuredOutputs
from baton.engine.runtime.torch_import import allow_torch
from baton.engine.structured_output.keywords import unenforced_keyword

if TYPE_CHECKING:
    import xgrammar as xgr

# A compiled grammar costs time and memory in proportion to its size times the vocabulary
# (a 250 KB schema: 4.5 s and 26 MB over a 494-token vocabulary), so specs are capped.
MAX_SPEC_CHARS = 64 * 1024
MAX_SCHEMA_DEPTH = 64  # as request bodies (server/openai/validation.py)
MAX_CHOICES = 1024

# JSON on one line with xgrammar's separators ", " and ": ", where vLLM's default allows any
# whitespace between tokens (its `disable_any_whitespace` off): small models then loop on
# whitespace until max_tokens. Strict mode: no properties or items beyond the schema's (as vLLM).
JSON_OPTIONS = {"any_whitespace": False, "strict_mode": True}
# response_format json_object: any JSON object (OpenAI's JSON mode), on one line as well.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
JSON_OBJECT_OPTIONS = {"any_whitespace": False, "strict_mode": False}


def check_structured_outputs(structured: StructuredOutputs) -> None:
    """Raise ValueError naming what is wrong with `structured` (see the module docstring)."""
    if len(structured.spec) > MAX_SPEC_CHARS:
        raise ValueError(
            f"structured_outputs: the {_NAMES[structured.kind]} is {len(structured.spec)} "
            f"characters, more than the {MAX_SPEC_CHARS} this server compiles"
        )
    if any(not isinstance(t, int) or t < 0 for t in structured.after_token_ids):
        raise ValueError("structured_outputs: after_token_ids must be token ids")
    kind = structured.kind
    if kind == "json":
        schema = load_json(structured.spec, "the JSON schema")
        _check_schema(schema)
    elif kind == "choice":
        choice_ebnf(structured.spec)
    elif kind == "structural_tag":
        for schema in _embedded_schemas(load_json(structural_tag_text(structured.spec), "")):
            _check_schema(schema)
    elif kind not in ("json_object", "regex", "grammar", "structural_tag"):
        raise ValueError(f"structured_outputs: unknown kind {kind!r}")
    try:
        parse(structured)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's errors for bad specs
        message = _xgrammar_message(error)
        raise ValueError(f"structured_outputs: invalid {_NAMES[kind]}: {message}") from None


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


@functools.cache
def xgrammar() -> ModuleType:
    """xgrammar, imported at the first spec: it brings torch (and ~0.3 s), which a server or an
    engine that never sees a structured request need not load (engine/runtime/torch_import.py)."""
    allow_torch()
    import xgrammar

    return xgrammar


def parse(structured: StructuredOutputs) -> xgr.Grammar:
    """The spec as an xgrammar Grammar (no tokenizer needed; raises for a bad spec)."""
    kind, spec = structured.kind, structured.spec
    xgr = xgrammar()
    if kind == "json":
        return xgr.Grammar.from_json_schema(spec, **JSON_OPTIONS)
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, **JSON_OBJECT_OPTIONS)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(spec))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec) if _is_ebnf(spec) else xgr.Grammar.from_lark(spec)
    return xgr.Grammar.from_structural_tag(structural_tag_text(spec))


def compile_structured(
    compiler: xgr.GrammarCompiler, structured: StructuredOutputs
) -> xgr.CompiledGrammar:
    """Compile through the compiler's own methods: its cache is keyed by the spec text, so a
    spec is compiled once while it stays in the cache."""
    kind, spec = structured.kind, structured.spec
    if kind == "json":
        return compiler.compile_json_schema(spec, **JSON_OPTIONS)
    if kind == "json_object":
        return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, **JSON_OBJECT_OPTIONS)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(spec))
    if kind == "grammar":
        return compiler.compile_grammar(spec) if _is_ebnf(spec) else compiler.compile_lark(spec)
    return compiler.compile_structural_tag(structural_tag_text(spec))


def _is_ebnf(grammar: str) -> bool:
    """GBNF / xgrammar EBNF defines rules with `::=`; anything else is read as Lark (as vLLM)."""
    return "::=" in grammar


def choice_ebnf(spec: str) -> str:
    """A JSON list of strings as a grammar whose language is exactly those strings."""
    choices = load_json(spec, "the choice list")
    if not isinstance(choices, list) or not choices:
        raise ValueError("structured_outputs: choice must be a non-empty list of strings")
    if len(choices) > MAX_CHOICES:
        raise ValueError(f"structured_outputs: choice has more than {MAX_CHOICES} strings")
    if not all(isinstance(choice, str) for choice in choices):
        raise ValueError("structured_outputs: choice must be a list of strings")
    # JSON string escapes are EBNF string escapes (\" \\ \n \uXXXX ...)
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def structural_tag_text(spec: str) -> str:
    """The structural tag in xgrammar's current form: vLLM's older {"structures": [{"begin",
    "schema", "end"}], "triggers"} becomes the triggered tags it stands for."""
    value = load_json(spec, "the structural tag")
    if not (isinstance(value, dict) and "structures" in value):
        return spec
    structures, triggers = value["structures"], value.get("triggers")
    if not (
        isinstance(structures, list)
        and all(
            isinstance(item, dict)
            and isinstance(item.get("begin"), str)
            and isinstance(item.get("end"), str)
            and isinstance(item.get("schema"), (dict, bool))
            for item in structures
        )
        and isinstance(triggers, list)
        and all(isinstance(trigger, str) for trigger in triggers)
    ):
        raise ValueError(
            "structured_outputs: a structural tag's `structures` must be objects with string "
            "`begin` and `end` and a `schema`, its `triggers` a list of strings"
        )
    tags = [
        {
            "type": "tag",
            "begin": item["begin"],
            "content": {"type": "json_schema", "json_schema": item["schema"]},
            "end": item["end"],
        }
        for item in structures
    ]
    triggered = {"type": "triggered_tags", "triggers": triggers, "tags": tags}
    return json.dumps({"type": "structural_tag", "format": triggered}, ensure_ascii=False)


def _embedded_schemas(value: Any) -> list[Any]:
    """The JSON schemas inside a structural tag (its `json_schema` formats)."""
    found, stack = [], [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append(node["json_schema"])
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def load_json(text: str, what: str) -> Any:
    """JSON text, strictly (no NaN / Infinity), nested at most MAX_SCHEMA_DEPTH levels."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError(
            f"structured_outputs: {what} nests deeper than {MAX_SCHEMA_DEPTH} levels"
        ) from None
    except ValueError as error:
        raise ValueError(f"structured_outputs: {what} is not valid JSON: {error}") from None
    level = [value]
    for _ in range(MAX_SCHEMA_DEPTH + 1):  # iterative: the input may be deep enough to overflow
        level = [
            child
            for node in level
            if isinstance(node, (dict, list))
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return value
    raise ValueError(f"structured_outputs: {what} nests deeper than {MAX_SCHEMA_DEPTH} levels")


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _check_schema(schema: Any) -> None:
    import jsonschema  # (imported here: ~0.1 s, only on the first schema)

    if not isinstance(schema, (dict, bool)):
        raise ValueError("structured_outputs: a JSON schema must be an object or a boolean")
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as error:
        where = "/" + "/".join(str(part) for part in error.path)
        raise ValueError(
            f"structured_outputs: invalid JSON schema at {where}: {error.message}"
        ) from None
    problem = unenforced_keyword(schema)
    if problem is not None:
        raise ValueError(f"structured_outputs: JSON schema {problem}")


def _xgrammar_message(error: Exception) -> str:
    """xgrammar's C++ errors start with a timestamp and a source position: the rest is the
    message meant for people."""
    text = str(error).strip()
    head, sep, rest = text.partition(": ")
    return rest.strip() if sep and head.startswith("[") else text
