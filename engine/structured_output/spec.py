"""What a StructuredOutputs may hold, checked before anything runs, and how it becomes a grammar.

`check_structured_outputs` is the whole check (ValueError naming the problem): the server runs it
in a worker thread before a request reaches its engine, the offline `LLM` before it adds one.
It returns the spec the engine compiles: a JSON schema (alone or inside a structural tag) is
lowered into what the grammar engine enforces exactly (engine/structured_output/schema/), or
refused naming the keyword and its path (xgrammar only logs a warning and drops what it cannot
enforce: an output "valid under the grammar" would then break the schema). It then parses the
spec with xgrammar (a syntax error in a regex or grammar is found here).
`compile_structured` is what the engine's compile thread runs (grammars.py).

xgrammar writes a string with a minLength / maxLength from a character class that lets raw
control characters through (a tab inside quotes: no longer JSON); `json_schema_grammar` is its
grammar for a lowered schema with that class replaced by JSON's string characters and escapes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from types import ModuleType
from typing import TYPE_CHECKING, Any

from baton.engine.core.sampling_params import StructuredOutputs
from baton.engine.runtime.torch_import import allow_torch
from baton.engine.structured_output.schema import MAX_LOWERED_CHARS, lowered_schema_text
from baton.engine.structured_output.schema.regex import parse_regex, regex_ebnf

if TYPE_CHECKING:
    import xgrammar as xgr

# A compiled grammar costs time and memory in proportion to its size times the vocabulary
# (a 250 KB schema: 4.5 s and 26 MB over a 494-token vocabulary), so what is compiled is capped:
# a regex, grammar or choice list as given, a JSON schema as lowered (annotations left out).
MAX_SPEC_CHARS = 64 * 1024
# A JSON schema (or structural tag) as a request gives it, descriptions and titles included.
MAX_SCHEMA_TEXT_CHARS = 1024 * 1024
MAX_SCHEMA_DEPTH = 64  # as request bodies (server/openai/validation.py)
MAX_CHOICES = 1024

# JSON on one line with xgrammar's separators ", " and ": ", where vLLM's default allows any
# whitespace between tokens (its `disable_any_whitespace` off): small models then loop on
# whitespace until max_tokens. Strict mode: no properties or items beyond the schema's (as vLLM).
JSON_OPTIONS = {"any_whitespace": False, "strict_mode": True}
# response_format json_object: any JSON object (OpenAI's JSON mode), on one line as well.
JSON_OBJECT_SCHEMA = '{"type": "object"}'
JSON_OBJECT_OPTIONS = {"any_whitespace": False, "strict_mode": False}

logger = logging.getLogger("baton.engine")


def compiled_spec_limit(kind: str) -> int:
    """The longest spec of `kind` the engine compiles (a JSON schema or structural tag: as
    lowered, annotations left out)."""
    return MAX_LOWERED_CHARS if kind in ("json", "structural_tag") else MAX_SPEC_CHARS


def check_structured_outputs(structured: StructuredOutputs) -> StructuredOutputs:
    """The spec the engine compiles for `structured` (a JSON schema lowered), or ValueError
    naming what is wrong (see the module docstring)."""
    kind = structured.kind
    limit = MAX_SCHEMA_TEXT_CHARS if kind in ("json", "structural_tag") else MAX_SPEC_CHARS
    if len(structured.spec) > limit:
        raise ValueError(
            f"structured_outputs: the {_NAMES.get(kind, kind)} is {len(structured.spec)} "
            f"characters, more than the {limit} this server compiles"
        )
    if any(not isinstance(t, int) or t < 0 for t in structured.after_token_ids):
        raise ValueError("structured_outputs: after_token_ids must be token ids")
    if kind == "json":
        spec = lowered_schema_text(load_json(structured.spec, "the JSON schema"))
        structured = dataclasses.replace(structured, spec=spec)
    elif kind == "choice":
        choice_ebnf(structured.spec)
    elif kind == "structural_tag":
        structured = dataclasses.replace(structured, spec=_lowered_tag(structured.spec))
    elif kind not in ("json_object", "regex", "grammar"):
        raise ValueError(f"structured_outputs: unknown kind {kind!r}")
    try:
        parse(structured)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's errors for bad specs
        message = _xgrammar_message(error, kind)
        raise ValueError(f"structured_outputs: invalid {_NAMES[kind]}: {message}") from None
    return structured


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
        return xgr.Grammar.from_ebnf(json_schema_grammar(spec))
    if kind == "json_object":
        return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, **JSON_OBJECT_OPTIONS)
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(spec))
    if kind == "grammar":
        return xgr.Grammar.from_ebnf(spec) if _is_ebnf(spec) else xgr.Grammar.from_lark(spec)
    return xgr.Grammar.from_structural_tag(_grammar_tag(spec))


def compile_structured(
    compiler: xgr.GrammarCompiler, structured: StructuredOutputs
) -> xgr.CompiledGrammar:
    """Compile a checked spec (check_structured_outputs' result) with the compiler's methods."""
    kind, spec = structured.kind, structured.spec
    if kind == "json":
        return compiler.compile_grammar(json_schema_grammar(spec))
    if kind == "json_object":
        return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, **JSON_OBJECT_OPTIONS)
    if kind == "regex":
        return compiler.compile_regex(spec)
    if kind == "choice":
        return compiler.compile_grammar(choice_ebnf(spec))
    if kind == "grammar":
        return compiler.compile_grammar(spec) if _is_ebnf(spec) else compiler.compile_lark(spec)
    return compiler.compile_structural_tag(_grammar_tag(spec))


# xgrammar's character of a string with a length bound, as it prints it (in `(([^...]))`, or
# `("" | ([^...]))` for at most one), and JSON's: any character but a quote, a backslash or a
# control character, or a two-character escape (a \uXXXX escape may be half of a surrogate
# pair, which would count as one character).
_LENGTH_CHARACTER = r"[^\"\\\r\n]"
_JSON_CHARACTER = r'([^\0-\x1f\"\\] | ("\\" [\"\\/bfnrt]))'


_PLACEHOLDER = "batonpatternplaceholder"


def json_schema_grammar(schema: str) -> str:
    """The grammar (EBNF) of a lowered JSON schema: xgrammar's, with JSON's string characters
    where a length bound let raw control characters through, and each pattern (given to
    xgrammar as a placeholder) as the rules regex.py writes for it."""
    patterns: dict[str, str] = {}  # pattern -> its placeholder
    value = _placeholders(json.loads(schema), patterns)
    grammar = str(xgrammar().Grammar.from_json_schema(json.dumps(value), **JSON_OPTIONS))
    grammar = grammar.replace(_LENGTH_CHARACTER, _JSON_CHARACTER)
    for pattern, placeholder in patterns.items():  # (absent where the grammar needs none)
        printed = f'Regex("{placeholder}", json_string=true)'
        grammar = grammar.replace(printed, regex_ebnf(parse_regex(pattern)))
    if _PLACEHOLDER in grammar:  # (one xgrammar wrote another way: its text would be written)
        raise ValueError("a pattern's placeholder is left in xgrammar's grammar")
    return grammar


def _placeholders(schema: Any, patterns: dict[str, str]) -> Any:
    """A lowered schema with each pattern (of a string, a pattern property, a property name)
    replaced by a placeholder regex xgrammar prints as written."""

    def placeholder(pattern: str) -> str:
        return patterns.setdefault(pattern, f"^{_PLACEHOLDER}{len(patterns)}$")

    if not isinstance(schema, dict) or "const" in schema or "enum" in schema:
        return schema
    out = dict(schema)
    if "pattern" in out:
        out["pattern"] = placeholder(out["pattern"])
    for key in ("items", "additionalProperties", "propertyNames"):
        if isinstance(out.get(key), dict):
            out[key] = _placeholders(out[key], patterns)
    for key in ("anyOf", "prefixItems"):
        if key in out:
            out[key] = [_placeholders(sub, patterns) for sub in out[key]]
    for key in ("properties", "$defs"):
        if key in out:
            out[key] = {name: _placeholders(sub, patterns) for name, sub in out[key].items()}
    if "patternProperties" in out:
        out["patternProperties"] = {
            placeholder(key): _placeholders(sub, patterns)
            for key, sub in out["patternProperties"].items()
        }
    return out


def _grammar_tag(spec: str) -> str:
    """A checked structural tag with each embedded (lowered) schema as its grammar."""
    value = json.loads(spec)
    for node in _schema_formats(value):
        schema = node.pop("json_schema")
        node["type"] = "grammar"
        node["grammar"] = json_schema_grammar(json.dumps(schema, ensure_ascii=False))
    return json.dumps(value, ensure_ascii=False)


def _lowered_tag(spec: str) -> str:
    """The structural tag (in xgrammar's current form) with each schema lowered."""
    value = load_json(structural_tag_text(spec), "the structural tag")
    for node in _schema_formats(value):
        node["json_schema"] = json.loads(lowered_schema_text(node["json_schema"]))
    text = json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_LOWERED_CHARS:
        raise ValueError(
            f"structured_outputs: the structural tag's schemas lower to {len(text)} characters, "
            f"more than the {MAX_LOWERED_CHARS} this server compiles"
        )
    return text


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


def _schema_formats(value: Any) -> list[dict]:
    """The `json_schema` formats inside a structural tag (the objects holding a schema)."""
    found, stack = [], [value]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "json_schema" and "json_schema" in node:
                found.append(node)
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


def _xgrammar_message(error: Exception, kind: str) -> str:
    """xgrammar's C++ errors start with a timestamp and a source position, and may hold its
    internals ("Check failed: (x) is false"): the rest is the message meant for people. A
    lowered JSON schema should never fail; if one does, the message says so without them."""
    text = str(error).strip()
    if kind in ("json", "structural_tag"):
        logger.warning("xgrammar refused a lowered %s: %s", kind, text)
        return "the grammar engine could not compile it (a gap in this server's lowering)"
    head, sep, rest = text.partition(": ")
    text = rest.strip() if sep and head.startswith("[") else text
    text = re.sub(r"Check failed: \(.*?\) is false:\s*", "", text)
    return re.sub(r"\S*/\S+\.(cc|h|cpp):\d+:?\s*", "", text)
