"""Structured outputs over HTTP, on the shipped model: a real `baton serve` and a real `baton up`
stack (router, prefill and decode workers), driven by the official `openai` client and httpx.

Every output that ends with "stop" follows its schema, regex or choice list (a "length" cut
cannot), and a disaggregated stack writes exactly what one colocated worker writes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from tests.server_process import start_server
from tests.test_server_up import Stack

ASSETS = Path(__file__).parents[1] / "assets"
# prefix-cache checkpoints every 64 tokens (page 4): the few-shot prompts below share 64+
FLAGS = ("--page-size", "4", "--mamba-track-interval", "64")
SHOT = "Question: Ann has 5 pens and buys 3 more. How many pens?\nAnswer: 8\n\n"
PROMPT = SHOT * 3 + "Question: Tom has 13 apples and buys 24 more. How many apples?\nAnswer:"


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    server = start_server(ASSETS, tmp_path_factory.mktemp("structured-serve"), *FLAGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def up(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured-up") / "up.log"
    stack = Stack(ASSETS, log, "--", *FLAGS)
    yield f"http://127.0.0.1:{stack.port}"
    stack.stop()


def complete(base_url: str, timeout: float = 60, **body) -> httpx.Response:
    body = {"model": str(ASSETS), "prompt": PROMPT, "max_tokens": 24, "temperature": 0, **body}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout)


def answers(response: httpx.Response) -> list[tuple[str, str]]:
    assert response.status_code == 200, response.text
    return [(c["text"], c["finish_reason"]) for c in response.json()["choices"]]


class Purchase(BaseModel):
    item: Literal["apples", "pens"]
    count: int = Field(ge=0, le=99)
    paid: bool


@pytest.mark.parametrize("where", ["serve", "up"])
def test_chat_completions_parse_returns_the_pydantic_object(where, request):
    server = request.getfixturevalue(where)
    base = server.base_url if where == "serve" else server
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    completion = client.chat.completions.parse(
        model=str(ASSETS),
        messages=[{"role": "user", "content": "Tom buys 24 apples. What did he buy?"}],
        response_format=Purchase,
        max_tokens=64,
        temperature=0,
    )
    purchase = completion.choices[0].message.parsed
    assert isinstance(purchase, Purchase), completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"


# -- the property: over generated schemas, regexes and choice lists ------------------------------

_LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.integers(-20, 20).map(lambda low: {"type": "integer", "minimum": low, "maximum": low + 30}),
    st.lists(st.sampled_from(["a", "b", "cd", "é"]), min_size=1, max_size=3, unique=True).map(
        lambda values: {"enum": values}
    ),
    st.integers(0, 3).map(lambda n: {"type": "string", "maxLength": n}),
    st.sampled_from([r"^[a-c]\d$", r"^x+$"]).map(lambda p: {"type": "string", "pattern": p}),
)


def _object(children):
    return st.dictionaries(
        st.sampled_from(["a", "b", "c"]), children, min_size=1, max_size=2
    ).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {
                "type": "object",
                "properties": props,
                "required": sorted(required),
            }
        )
    )


SCHEMAS = st.recursive(
    _LEAVES,
    lambda children: st.one_of(
        _object(children),
        children.map(lambda items: {"type": "array", "items": items, "maxItems": 2}),
        st.lists(children, min_size=2, max_size=2).map(lambda options: {"anyOf": options}),
    ),
    max_leaves=4,
)
REGEXES = st.lists(
    st.tuples(
        st.sampled_from(["[a-c]", r"\d", "x", "(ab|c)", "[^a-z]"]),
        st.sampled_from(["", "?", "{1,2}", "+"]),
    ),
    min_size=1,
    max_size=4,
).map(lambda parts: "".join(atom + count for atom, count in parts))
CHOICES = st.lists(
    st.text(alphabet='ab "\\\né7', min_size=1, max_size=4), min_size=1, max_size=4, unique=True
)


def _follows(kind: str, spec, text: str) -> bool:
    if kind == "json":
        jsonschema.validate(json.loads(text), spec)  # raises, naming the broken rule
        return True
    if kind == "regex":
        return re.fullmatch(spec, text) is not None
    return text in spec


def _check_same_and_valid(serve, up, kind: str, spec) -> None:
    field = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice"}[kind]
    body = {field: spec, "n": 2, "seed": 5, "temperature": 1.0, "max_tokens": 20}
    colocated = answers(complete(serve.base_url, **body))
    assert answers(complete(up, **body)) == colocated
    for text, finish in colocated:
        assert finish in ("stop", "length")
        if finish == "stop":
            assert _follows(kind, spec, text), (spec, text)


PROPERTY = settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@PROPERTY
@given(schema=SCHEMAS)
def test_outputs_follow_generated_schemas_colocated_and_disaggregated(serve, up, schema):
    _check_same_and_valid(serve, up, "json", schema)


@PROPERTY
@given(regex=REGEXES)
def test_outputs_follow_generated_regexes_colocated_and_disaggregated(serve, up, regex):
    _check_same_and_valid(serve, up, "regex", regex)


@PROPERTY
@given(choices=CHOICES)
def test_outputs_follow_generated_choices_colocated_and_disaggregated(serve, up, choices):
    _check_same_and_valid(serve, up, "choice", choices)


# -- every way to ask --------------------------------------------------------------------------

SCHEMA = Purchase.model_json_schema()


@pytest.mark.parametrize(
    ("body", "valid"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
                }
            },
            lambda text: Purchase.model_validate_json(text),
        ),
        (
            {"response_format": {"type": "json_object"}},
            lambda text: isinstance(json.loads(text), dict),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, lambda text: Purchase.model_validate_json(text)),
        ({"structured_outputs": {"regex": r"\d{2}"}}, lambda text: re.fullmatch(r"\d{2}", text)),
        ({"structured_outputs": {"choice": ["x", "y"]}}, lambda text: text in ("x", "y")),
        (
            {"structured_outputs": {"grammar": 'root ::= "n=" [0-9] [0-9]?'}},
            lambda text: re.fullmatch(r"n=\d\d?", text),
        ),
        (
            {
                "structured_outputs": {
                    "structural_tag": {
                        "type": "structural_tag",
                        "format": {"type": "const_string", "value": "<ok/>"},
                    }
                }
            },
            lambda text: text == "<ok/>",
        ),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else "",
)
def test_each_request_field_constrains_completions_and_chat_streamed_or_not(serve, body, valid):
    ((text, finish),) = answers(complete(serve.base_url, max_tokens=64, **body))
    assert finish == "stop" and valid(text), text
    chat = {"model": str(ASSETS), "messages": [{"role": "user", "content": "Tom buys 24 apples."}]}
    chat |= {"max_tokens": 64, "temperature": 0, **body}
    with serve.http() as http:
        whole = http.post("/v1/chat/completions", json=chat).json()["choices"][0]
        assert whole["finish_reason"] == "stop" and valid(whole["message"]["content"])
        streamed = ""
        with http.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as events:
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        streamed += choice["delta"].get("content") or ""
        assert streamed == whole["message"]["content"]


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("json_schema", json.dumps(SCHEMA), lambda text: Purchase.model_validate_json(text)),
        ("regex", "[a-c]{3}", lambda text: re.fullmatch("[a-c]{3}", text)),
        ("ebnf", 'root ::= "k" [0-9]', lambda text: re.fullmatch(r"k\d", text)),
    ],
)
def test_sglang_generate_takes_its_constraint_fields_through_the_router(up, field, value, valid):
    body = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 64, "temperature": 0, field: value},
    }
    answer = httpx.post(f"{up}/generate", json=body, timeout=60).json()
    assert answer["meta_info"]["finish_reason"]["type"] == "stop" and valid(answer["text"])


# -- refusals ----------------------------------------------------------------------------------

REFUSED = [
    (
        {
            "guided_json": {
                "type": "object",
                "properties": {"a": {"type": "array", "uniqueItems": True}},
            }
        },
        "guided_json",
        "at /properties/a/uniqueItems: 'uniqueItems'",
    ),
    ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json", "minimum"),
    ({"guided_regex": "a(b"}, "guided_regex", "invalid regex"),
    # found by the engine once compiled: it cannot know the field
    ({"structured_outputs": {"grammar": "root ::= root"}}, None, "admits no output"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    (
        {"structured_outputs": {"json": {}, "whitespace_pattern": " "}},
        "structured_outputs",
        "whitespace_pattern",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "schema is required",
    ),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "give one"),
    ({"guided_choice": "yes"}, "guided_choice", "list of strings"),
]


@pytest.mark.parametrize(("body", "param", "message"), REFUSED, ids=lambda v: str(v)[:30])
def test_a_bad_constraint_is_a_400_naming_it_colocated_and_through_the_router(
    serve, up, body, param, message
):
    for base in (serve.base_url, up):
        response = complete(base, **body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert message in error["message"] and error["param"] == param, error


# -- hostile input -----------------------------------------------------------------------------


def _huge_schema(fields: int) -> dict:
    members = {f"g{j}": {"type": ["string", "integer", "boolean"]} for j in range(8)}
    return {
        "type": "object",
        "properties": {
            f"field_{i}": {"type": "object", "properties": members} for i in range(fields)
        },
    }


HOSTILE = [
    ("huge schema, under the size limit", {"guided_json": _huge_schema(120)}),
    ("schema over the size limit", {"guided_json": _huge_schema(200)}),
    (
        "schema text nested 80 deep",
        {"guided_json": '{"type": "array", "items": ' * 80 + "{}" + "}" * 80},
    ),
    (
        "recursive schema that never ends",
        {
            "guided_json": {
                "$defs": {
                    "n": {
                        "type": "object",
                        "properties": {"c": {"$ref": "#/$defs/n"}},
                        "required": ["c"],
                    }
                },
                "$ref": "#/$defs/n",
            }
        },
    ),
    ("unsatisfiable schema", {"guided_json": {"type": "string", "minLength": 5, "maxLength": 2}}),
    ("schema false", {"guided_json": False}),
    ("contradictory allOf", {"guided_json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}),
    ("backtracking regex", {"guided_regex": "(a+)+$"}),
    ("backtracking alternation", {"guided_regex": "(x|x|xx)*y"}),
    ("huge repetition", {"guided_regex": "(a{1000}){1000}"}),
    ("grammar with no terminal", {"guided_grammar": "root ::= a\na ::= root"}),
    ("ambiguous grammar", {"guided_grammar": 'root ::= s "b"\ns ::= s s | "a" | ""'}),
]


def test_hostile_specs_get_a_400_or_end_within_limits_while_others_stream(serve):
    """Each hostile spec is refused or generates within max_tokens; never a 5xx; and a plain
    stream running beside them keeps receiving tokens while the huge schema compiles."""
    import threading
    import time

    chunks: list[float] = []  # when each chunk of the plain stream arrived
    finishes: list[str | None] = []
    body = {"model": str(ASSETS), "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}

    def stream() -> None:
        with (
            serve.http() as http,
            http.stream("POST", "/v1/completions", json={**body, "stream": True}) as events,
        ):
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(time.monotonic())
                    finishes.append(json.loads(line[6:])["choices"][0]["finish_reason"])

    reader = threading.Thread(target=stream)
    reader.start()
    while not chunks:
        time.sleep(0.01)
    windows = []
    for name, constraint in HOSTILE:
        sent = time.monotonic()
        response = complete(serve.base_url, max_tokens=32, **constraint)
        windows.append((sent, time.monotonic()))
        assert response.status_code in (200, 400), (name, response.text)
        if response.status_code == 200:
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] in ("stop", "length", "abort"), name
            assert response.json()["usage"]["completion_tokens"] <= 32, name
        else:
            assert response.json()["error"]["param"] in (
                "guided_json",
                "guided_regex",
                "guided_grammar",
                None,
            )
    reader.join(120)
    sent, answered = windows[0]  # the huge schema: checked, compiled, then generated
    assert sum(sent < t < answered for t in chunks) >= 2
    assert finishes[-1] == "length"  # the stream ran to its end
    assert serve.http().get("/health").status_code == 200


# -- /v1/responses: text.format behind the same check as chat and completions -----------------


def respond(base_url: str, text_format: dict, **body) -> httpx.Response:
    body = {
        "model": str(ASSETS),
        "input": "Tom has 13 apples and buys 24 more. How many apples?",
        "max_output_tokens": 40,
        "temperature": 0,
        "text": {"format": text_format},
        **body,
    }
    return httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)


RESPONSES_REFUSED = [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "at /uniqueItems"),
    ({"type": "string", "not": {"pattern": "^a"}}, "at /not"),
    ({"$ref": "https://example.com/schema.json"}, "at /$ref"),
    ({"type": "string", "pattern": "^(?!x)"}, "at /pattern"),
    ({"type": "integer", "minimum": 3, "maximum": 1}, "no integer lies between its minimum"),
]


@pytest.mark.parametrize(("schema", "named"), RESPONSES_REFUSED, ids=lambda v: str(v)[:30])
def test_responses_text_format_is_refused_as_chat_would_naming_keyword_and_path(
    serve, schema, named
):
    text_format = {"type": "json_schema", "name": "answer", "schema": schema}
    chat = complete(
        serve.base_url,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema},
        },
    )
    response = respond(serve.base_url, text_format)
    for answer in (chat, response):
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert named in error["message"], error
        assert ".cc" not in error["message"] and "xgrammar" not in error["message"], error
    assert response.json()["error"]["param"] == "text"
    assert response.json()["error"]["message"].startswith("text.format: JSON schema ")


def test_responses_text_format_writes_what_the_schema_allows(serve):
    schema = {
        "type": "object",
        "properties": {"count": {"type": "integer", "minimum": 0, "multipleOf": 12}},
        "required": ["count"],
        "format": "not-a-known-format",  # an annotation: accepted, nothing to enforce
    }
    for seed in range(3):
        response = respond(
            serve.base_url,
            {"type": "json_schema", "name": "answer", "schema": schema},
            temperature=1.0,
            seed=seed,
        )
        assert response.status_code == 200, response.text
        (message,) = [item for item in response.json()["output"] if item["type"] == "message"]
        text = message["content"][0]["text"]
        if response.json()["status"] == "completed":
            jsonschema.validate(json.loads(text), schema)


def test_a_forced_tool_call_resolves_refs_to_its_own_parameters(serve):
    """`$ref: "#"` in a tool's parameters is the tool's schema, not tool_choice=required's array
    of calls (arguments once came back as {"c": [{"name": "t", "parameters": ...}]})."""
    parameters = {
        "type": "object",
        "properties": {
            "v": {"type": "integer", "minimum": 0, "maximum": 9},
            "c": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
        },
        "required": ["v", "c"],
    }
    tools = [{"type": "function", "function": {"name": "t", "parameters": parameters}}]
    body = {
        "model": str(ASSETS),
        "messages": [{"role": "user", "content": "Make a tree."}],
        "tools": tools,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 200,
        "temperature": 1.0,
    }
    nested = 0  # calls whose `c` holds a node: where the reference was resolved
    for seed in range(16):
        response = httpx.post(
            f"{serve.base_url}/v1/chat/completions", json={**body, "seed": seed}, timeout=60
        )
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        if choice["finish_reason"] != "tool_calls":
            continue  # (cut by max_tokens: its arguments are partial)
        (call,) = choice["message"]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        jsonschema.validate(arguments, parameters)
        nested += bool(arguments["c"])
    assert nested, "no whole call with a nested node in 16 tries"
