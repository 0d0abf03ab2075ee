"""The battery's structured-output requests (bench/serving/api_battery.py adds them to its cases): every
way a vLLM or OpenAI client asks for a constrained answer, and the malformed ones."""

from __future__ import annotations

from typing import Any

from baton.bench.serving.api_battery import MESSAGES, QUESTION, Case

SCHEMA = {
    "type": "object",
    "properties": {
        "item": {"enum": ["apples", "pens"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["item", "count"],
}


def structured_cases(model: str) -> list[Case]:
    c = "/v1/completions"
    ch = "/v1/chat/completions"
    g = {"model": model, "temperature": 0, "max_tokens": 40}
    cmp = {**g, "prompt": QUESTION}
    chat = {**g, "messages": MESSAGES}
    json_schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    strict = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}
    return [
        # ---- valid: OpenAI's response_format
        Case("c.so.response_format_json_schema", c, {**cmp, "response_format": json_schema}, greedy=True),
        Case("ch.so.response_format_json_schema", ch, {**chat, "response_format": json_schema}, greedy=True),
        Case("ch.so.response_format_strict", ch, {**chat, "response_format": strict}, greedy=True),
        Case(
            "ch.so.response_format_json_schema.stream",
            ch,
            {**chat, "response_format": json_schema, "stream": True},
            greedy=True,
        ),
        Case("ch.so.response_format_json_object", ch, {**chat, "response_format": {"type": "json_object"}}, greedy=True),
        # ---- valid: vLLM's structured_outputs
        Case("c.so.json", c, {**cmp, "structured_outputs": {"json": SCHEMA}}, greedy=True),
        Case("c.so.regex", c, {**cmp, "structured_outputs": {"regex": r"[0-9]{2}"}}, greedy=True),
        Case("c.so.choice", c, {**cmp, "structured_outputs": {"choice": ["seven", "eight"]}}, greedy=True),
        Case(
            "c.so.grammar",
            c,
            {**cmp, "structured_outputs": {"grammar": 'root ::= "n=" [0-9] [0-9]?'}},
            greedy=True,
        ),
        Case("c.so.json_object", c, {**cmp, "structured_outputs": {"json_object": True}}, greedy=True),
        Case(
            "c.so.regex.stream",
            c,
            {**cmp, "structured_outputs": {"regex": r"[0-9]{2}"}, "stream": True},
            greedy=True,
        ),
        Case(
            "c.so.choice.n2",
            c,
            {**cmp, "structured_outputs": {"choice": ["a", "b", "c"]}, "n": 2, "temperature": 1, "seed": 3},
        ),
        Case(
            "c.so.regex.logprobs",
            c,
            {**cmp, "structured_outputs": {"regex": r"[0-9]{2}"}, "logprobs": 3},
            greedy=True,
        ),
        Case(
            "c.so.regex.length",
            c,
            {**cmp, "structured_outputs": {"regex": r"[0-9]+"}, "max_tokens": 3},
            greedy=True,
        ),
        # ---- valid: the older guided_* fields (vLLM 0.32 drops them without a word)
        Case("c.so.guided_json", c, {**cmp, "guided_json": SCHEMA}, greedy=True),
        Case("c.so.guided_regex", c, {**cmp, "guided_regex": r"[0-9]{2}"}, greedy=True),
        Case("c.so.guided_choice", c, {**cmp, "guided_choice": ["seven", "eight"]}, greedy=True),
        Case("ch.so.guided_grammar", ch, {**chat, "guided_grammar": 'root ::= "yes" | "no"'}, greedy=True),
        # ---- malformed
        Case("c.so.bad_regex", c, {**cmp, "structured_outputs": {"regex": "a(b"}}),
        Case("c.so.bad_grammar", c, {**cmp, "structured_outputs": {"grammar": "root ::= "}}),
        Case("c.so.bad_schema", c, {**cmp, "structured_outputs": {"json": {"type": "objet"}}}),
        Case("c.so.unenforced_keyword", c, {**cmp, "structured_outputs": {"json": {"type": "string", "not": {"const": "a"}}}}),
        Case("c.so.two_constraints", c, {**cmp, "structured_outputs": {"regex": "a", "choice": ["b"]}}),
        Case("c.so.empty_choice", c, {**cmp, "structured_outputs": {"choice": []}}),
        Case("c.so.no_terminal", c, {**cmp, "structured_outputs": {"grammar": "root ::= root"}}),
        Case("ch.so.response_format_no_schema", ch, {**chat, "response_format": {"type": "json_schema"}}),
        Case("ch.so.response_format_unknown", ch, {**chat, "response_format": {"type": "yaml"}}),
        Case("ch.so.response_format_and_structured", ch, {**chat, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}),
    ]  # fmt: skip


def structured_client_calls(model: str) -> list[tuple[str, Any]]:
    """`chat.completions.parse` with a Pydantic model, as the official client sends it."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Purchase(BaseModel):
        item: Literal["apples", "pens"]
        count: int = Field(ge=0, le=99)

    chat = {"model": model, "messages": MESSAGES, "max_tokens": 40, "temperature": 0}
    return [
        ("chat.parse", lambda c: c.chat.completions.parse(**chat, response_format=Purchase)),
    ]
