"""Error answers (OpenAI shape, right status, a message naming the problem), the API key, the
waiting-queue limit and /metrics, against one live `baton serve` with a key and a queue of one.
"""

from __future__ import annotations

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


def test_prompt_over_the_context_names_both_numbers(client):
    error = completion_error(client, prompt=[5] * 100, max_tokens=MAX_MODEL_LEN - 50)
    assert_openai_error(error, 400, "100 tokens", str(MAX_MODEL_LEN - 50), str(MAX_MODEL_LEN))


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
