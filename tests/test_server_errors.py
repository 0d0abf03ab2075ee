"""Error answers (OpenAI shape, right status, a message naming the problem), the API key, the
waiting-queue limit and /metrics, against one live `baton serve` with a key and a queue of one.
"""

from __future__ import annotations

import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import start_server, tiny_model

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 2048
API_KEY = "sesame"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = tiny_model(tmp_path_factory)
    server = start_server(
        model_dir,
        tmp_path_factory.mktemp("logs"),
        "--served-model-name", MODEL_NAME,
        "--max-model-len", str(MAX_MODEL_LEN),
        "--max-running-requests", "1",
        "--max-queued-requests", "1",
        api_key=API_KEY,
    )  # fmt: skip
    yield server
    assert server.stop() == 0, server.log()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def completion_error(client, **kwargs) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(
            **{"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, **kwargs}
        )
    return caught.value


def assert_openai_error(error: openai.APIStatusError, status: int, *needles: str) -> None:
    assert error.status_code == status
    body = error.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in body["message"], body["message"]


@pytest.mark.parametrize(
    ("kwargs", "param", "needles"),
    [
        ({"max_tokens": -1}, "max_tokens", ["max_tokens", "-1"]),
        ({"temperature": -0.5}, "temperature", ["temperature", ">= 0"]),
        ({"top_p": 0.0}, "top_p", ["top_p", "(0, 1]"]),
        ({"top_p": 1.5}, "top_p", ["top_p", "(0, 1]"]),
        ({"prompt": ""}, "prompt", ["prompt must not be empty"]),
        ({"prompt": []}, "prompt", ["prompt must not be empty"]),
        ({"prompt": [5, 100000]}, "prompt", ["100000", "outside the vocabulary"]),
        ({"max_tokens": 3000}, "max_tokens", ["3000", str(MAX_MODEL_LEN)]),
        ({"n": 0}, "n", ["n"]),
        ({"stream": True, "max_tokens": -1}, "max_tokens", ["max_tokens"]),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else None,
)
def test_invalid_completion_parameters_answer_400_naming_them(client, kwargs, param, needles):
    error = completion_error(client, **kwargs)
    assert_openai_error(error, 400, *needles)
    assert error.param == param


def test_max_tokens_past_the_context_are_cut_to_what_it_leaves_as_vllm_does(client):
    """vLLM (0.32) answers prompt + max_tokens over the context with the tokens that fit,
    finish_reason "length", rather than a 400; clients that always ask for a generous
    max_tokens (lm-evaluation-harness's max_gen_toks) rely on it."""
    prompt = [5] * (MAX_MODEL_LEN - 4)
    extra = {"extra_body": {"ignore_eos": True}}
    completion = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, **extra
    )
    assert completion.usage.completion_tokens == 4
    assert completion.choices[0].finish_reason == "length"
    listed = client.completions.create(
        model=MODEL_NAME, prompt=[prompt, [5] * 8], max_tokens=10, temperature=0, **extra
    )  # each prompt of a list gets what its own length leaves
    assert listed.usage.completion_tokens == 4 + 10
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi " * (MAX_MODEL_LEN // 4)}],
        max_tokens=MAX_MODEL_LEN - 1,
        temperature=0,
        **extra,
    )
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage.total_tokens == MAX_MODEL_LEN


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_prompt_that_leaves_no_room_in_the_context_is_refused_naming_both_numbers(
    client, endpoint
):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "completions":
            client.completions.create(model=MODEL_NAME, prompt=[5] * MAX_MODEL_LEN, max_tokens=4)
        else:
            client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "hi " * (MAX_MODEL_LEN + 10)}],
                max_tokens=4,
            )
    assert_openai_error(caught.value, 400, "tokens", "exceeds max-model-len", str(MAX_MODEL_LEN))
    assert caught.value.body["param"] == ("prompt" if endpoint == "completions" else "messages")


def test_invalid_chat_requests_answer_400(client):
    for kwargs, needle in [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL_NAME, max_tokens=4, **kwargs)
        assert_openai_error(caught.value, 400, needle)


def test_nan_is_refused_with_400(server):
    with server.http() as http:
        response = http.post(
            "/v1/completions",
            content=b'{"model": "tiny", "prompt": "hi", "temperature": NaN}',
            headers={"content-type": "application/json"},
        )
    assert response.status_code == 400 and "temperature" in response.json()["error"]["message"]


def test_unknown_model_answers_404(client):
    error = completion_error(client, model="gpt-17")
    assert_openai_error(error, 404, "gpt-17", MODEL_NAME)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])


def test_unknown_extra_fields_are_ignored(client):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=3,
        extra_body={"no_such_field": {"x": 1}, "best_of_luck": 3},
    )
    assert response.usage.completion_tokens >= 1


def test_api_key_guards_v1_but_not_health_or_metrics(server):
    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0
        ).models.list()
    assert_openai_error(caught.value, 401, "invalid API key")
    missing = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "hi"})
    assert missing.status_code == 401 and "missing API key" in missing.json()["error"]["message"]
    assert [model.id for model in server.client().models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/metrics").status_code == 200


def scrape(server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, sorted labels)."""
    with server.http() as http:
        text = http.get("/metrics").text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def wait_for_metric(server, name: str, value: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while scrape(server).get((name, ())) != value:
        assert time.monotonic() < deadline, f"{name} never reached {value}"
        time.sleep(0.05)


def test_full_waiting_queue_answers_503(server, client):
    long = {
        "model": MODEL_NAME,
        "prompt": "Hello",
        "max_tokens": 1500,
        "extra_body": {"ignore_eos": True},
    }
    running = client.completions.create(stream=True, **long)
    next(iter(running))  # it has produced a token: it holds the one running place
    waiting = client.completions.create(stream=True, **long)
    try:
        wait_for_metric(server, "baton:num_requests_waiting", 1.0)
        error = completion_error(client)
        assert_openai_error(error, 503, "waiting queue is full", "--max-queued-requests 1")
    finally:
        running.close()
        waiting.close()
    wait_for_metric(server, "baton:num_requests_running", 0.0)
    wait_for_metric(server, "baton:num_requests_waiting", 0.0)
    assert (
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2).choices[0].text
        is not None
    )


def test_metrics_parse_and_count_the_requests_made(server, client):
    endpoint_ok = ("baton:requests_total", (("endpoint", "/v1/completions"), ("status", "200")))
    endpoint_bad = ("baton:requests_total", (("endpoint", "/v1/completions"), ("status", "400")))
    before = scrape(server)
    for _ in range(3):
        client.completions.create(
            model=MODEL_NAME, prompt="Hello world", max_tokens=5, extra_body={"ignore_eos": True}
        )
    completion_error(client, max_tokens=-1)
    after = scrape(server)
    assert after[endpoint_ok] - before.get(endpoint_ok, 0) == 3
    assert after[endpoint_bad] - before.get(endpoint_bad, 0) == 1
    assert (
        after[("baton:generation_tokens_total", ())] - before[("baton:generation_tokens_total", ())]
        == 15
    )
    assert after[("baton:prompt_tokens_total", ())] > before[("baton:prompt_tokens_total", ())]
    for histogram in ("time_to_first_token", "e2e_request_latency"):
        name = f"baton:{histogram}_seconds_count"
        assert after[(name, ())] - before.get((name, ()), 0) == 3
    assert (
        after[("baton:inter_token_latency_seconds_count", ())]
        - before[("baton:inter_token_latency_seconds_count", ())]
        == 12
    )
    for gauge in ("kv_pages_total", "mamba_slots_total"):
        assert after[(f"baton:{gauge}", ())] > 0


def post_raw(server, path: str, raw: bytes, **headers: str) -> httpx.Response:
    """A body as the client wrote it (the openai client cannot send lone surrogates or NaN)."""
    with server.http() as http:
        return http.post(path, content=raw, headers={"content-type": "application/json", **headers})


LONE = '"\\ud800"'  # JSON text for a lone UTF-16 surrogate: valid JSON, not valid Unicode


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", f'{{"prompt": {LONE}}}', "prompt"),
        ("/v1/completions", f'{{"prompt": ["ok", {LONE}]}}', "prompt"),
        ("/v1/completions", f'{{"prompt": "hi", "stop": {LONE}}}', "stop"),
        ("/v1/completions", f'{{"prompt": "hi", "stop": ["a", {LONE}]}}', "stop"),
        ("/v1/completions", f'{{"prompt": "hi", "model": {LONE}}}', "model"),
        ("/v1/completions", f'{{"prompt": "hi", "user": {LONE}}}', "user"),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": {LONE}}}]}}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": {LONE}}}]}}]}}',
            "messages",
        ),
        (
            "/v1/chat/completions",
            f'{{"messages": [{{"role": "user", "content": "hi"}}], "stream": true, "stop": [{LONE}]}}',
            "stop",
        ),
        ("/tokenize", f'{{"prompt": {LONE}}}', "prompt"),
    ],
)
def test_lone_surrogates_answer_400_naming_the_field(server, path, body, param):
    response = post_raw(server, path, body.encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"], error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": "16"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": True}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 4.0}, "max_tokens"),
        ({"prompt": "hi", "n": True}, "n"),
        ({"prompt": "hi", "seed": "7"}, "seed"),
        ({"prompt": "hi", "temperature": "0.5"}, "temperature"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "ignore_eos": 1}, "ignore_eos"),
        (
            {"prompt": "hi", "stream_options": {"include_usage": "yes"}, "stream": True},
            "stream_options",
        ),
        ({"prompt": [1, True, 3]}, "prompt"),
    ],
    ids=repr,
)
def test_types_are_strict_as_in_openai(server, body, param):
    with server.http() as http:
        response = http.post("/v1/completions", json={"model": MODEL_NAME, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_an_int_is_still_a_valid_float(client):
    response = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2, temperature=0)
    assert response.choices[0].finish_reason in ("stop", "length")


def test_chat_roles_are_openais(server, client):
    with server.http() as http:
        response = http.post(
            "/v1/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "wizard", "content": "hi"}]},
        )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages" and "'developer'" in error["message"], error
    for role in ("system", "developer", "user"):
        answer = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": role, "content": "hi"}], max_tokens=2
        )
        assert answer.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b'{"prompt": "hi", "max_tokens": 2, "extra": NaN}', "NaN"),
        (b'{"prompt": "hi", "max_tokens": 2, "temperature": Infinity}', "Infinity"),
        (b'{"prompt": "hi", "max_tokens": 2, "temperature": -Infinity}', "Infinity"),
        (b'{"prompt": "hi", "max_tokens": 2, "top_p": 1e400}', "1e400"),
        (b'{"prompt": "hi", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b'{"prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}", "not valid JSON"),
        (b'{"prompt": "hi"', "not valid JSON"),
        (b'"just a string"', "JSON object"),
    ],
    ids=["nan", "inf", "-inf", "1e400", "deep-field", "deep-body", "huge-int", "truncated", "str"],
)
def test_json_the_strict_parser_refuses_answers_400(server, raw, needle):
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        response = post_raw(server, path, raw)
        assert response.status_code == 400, (path, response.text[:300])
        assert needle in response.json()["error"]["message"], response.json()


def _history_with_arguments(path: str, arguments: str) -> dict:
    """A conversation whose earlier assistant turn called a tool with `arguments`."""
    if path == "/v1/responses":
        items = [
            {"type": "message", "role": "user", "content": "hi"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ]
        return {"model": MODEL_NAME, "input": items, "max_output_tokens": 2}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": 2}


def _nested(levels: int) -> str:
    """Tool-call arguments nested `levels` deep: an object around arrays, and at the bottom a
    string of brackets (and an escaped quote) that must not count."""
    return '{"a": ' + "[" * (levels - 1) + '"\\"[[{{"' + "]" * (levels - 1) + "}"


@pytest.mark.parametrize(
    ("path", "param", "field"),
    [
        ("/v1/chat/completions", "messages", "messages.1.tool_calls.0.function.arguments"),
        ("/v1/responses", "input", "input.1.FunctionCallItem.arguments"),
    ],
)
def test_tool_call_arguments_nested_too_deep_answer_400_and_the_server_serves_on(
    server, path, param, field
):
    """Arguments are JSON text inside the body, so the body's depth check cannot see them; a
    1,000-deep one overflowed the stack where the history is rendered (a plain-text 500)."""
    with server.http() as http:
        for levels in (65, 1_000, 100_000):
            response = http.post(path, json=_history_with_arguments(path, _nested(levels)))
            assert response.status_code == 400, (levels, response.text[:300])
            error = response.json()["error"]
            assert error["param"] == param, error
            assert error["message"] == f"{field}: JSON nested deeper than 64 levels", error
        unclosed = http.post(path, json=_history_with_arguments(path, "[" * 100_000))
        assert unclosed.status_code == 400, unclosed.text[:300]
        for arguments in (_nested(64), "not JSON {", "[" * 100):  # rendered as {}, as before
            response = http.post(path, json=_history_with_arguments(path, arguments))
            assert response.status_code == 200, (arguments[:20], response.text[:300])


def test_body_over_max_request_bytes_answers_413_in_the_openai_shape(server):
    nine_mb = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    declared = post_raw(server, "/v1/completions", nine_mb)

    def chunks():  # no Content-Length: the limit must hold while reading, too
        for start in range(0, len(nine_mb), 1 << 20):
            yield nine_mb[start : start + (1 << 20)]

    with server.http() as http:
        streamed = http.post(
            "/tokenize", content=chunks(), headers={"content-type": "application/json"}
        )
    for response in (declared, streamed):
        assert response.status_code == 413, response.text[:300]
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert (
            "--max-request-bytes" in error["message"] and str(8 * 1024 * 1024) in error["message"]
        )
    assert server.client().completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2).usage


def test_api_key_guards_tokenize_detokenize_and_the_docs(server):
    url = server.base_url
    guarded = [
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [5, 6]}),
        ("GET", "/docs", None),
        ("GET", "/openapi.json", None),
        ("GET", "/v1/models", None),
    ]
    for method, path, body in guarded:
        assert httpx.request(method, url + path, json=body).status_code == 401, path
        for scheme in ("Bearer", "bearer", "BEARER"):
            headers = {"Authorization": f"{scheme} {API_KEY}"}
            response = httpx.request(method, url + path, json=body, headers=headers)
            assert response.status_code == 200, (path, scheme, response.text[:200])
        wrong = httpx.request(method, url + path, json=body, headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401
    for path in ("/health", "/metrics"):
        assert httpx.get(url + path).status_code == 200, path


def assert_unending_headers_refused(server) -> None:
    """20 KB of one header and no blank line: h11's 16 KB bound answers 400 (HTTP_PROTOCOL pins
    h11: uvicorn's httptools protocol would keep buffering), and the process keeps serving."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    with server.http() as http:
        assert http.get("/health").status_code == 200


def test_headers_that_never_end_answer_400_and_nothing_is_buffered_unbounded(server):
    assert_unending_headers_refused(server)
