"""Router -> prefill worker -> decode worker, as real processes on 127.0.0.1."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import signal
import threading
import time

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from tests.server_process import start_router, start_server

WORKER_FLAGS = (
    "--page-size",
    "4",
    "--chunked-prefill-size",
    "32",
    "--max-num-batched-tokens",
    "64",
)


def gauge(server, name: str, **labels: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and labels.items() <= sample.labels.items():
                return sample.value
    raise KeyError(name)


def pools_return_to_zero(worker, timeout: float = 10.0) -> list[float]:
    """KV pages and Mamba slots in use on `worker`, once both are zero or after `timeout` (a
    failure reaches the client a moment before the worker's next stats reach its server)."""
    deadline = time.time() + timeout
    while True:
        used = [gauge(worker, f"baton:{n}") for n in ("kv_pages_used", "mamba_slots_used")]
        if used == [0, 0] or time.time() > deadline:
            return used
        time.sleep(0.1)


def prompts(n: int = 16) -> list[list[int]]:
    lengths = [1, 5, 17, 33, 40, 64, 90, 130, 3, 8, 31, 32, 45, 77, 100, 12][:n]
    return [[(7 * i + 3 * j) % 300 + 3 for j in range(length)] for i, length in enumerate(lengths)]


def complete(
    base_url: str, prompt, max_tokens: int = 12, timeout: float = 60.0, **extra
) -> httpx.Response:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny import save_tiny_model

    path = tmp_path_factory.mktemp("disagg-model")
    save_tiny_model(path, seed=0)
    return path


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("disagg-logs")


@pytest.fixture(scope="module")
def colocated(model_dir, logs):
    server = start_server(model_dir, logs, *WORKER_FLAGS)
    expected = {}
    for i, prompt in enumerate(prompts()):
        expected[i] = complete(server.base_url, prompt).json()["choices"][0]["text"]
    yield server, expected
    server.stop()


@pytest.fixture(scope="module")
def stack(model_dir, logs):
    prefill = start_server(
        model_dir, logs, *WORKER_FLAGS, "--disaggregation-mode", "prefill", "--disagg-timeout", "30"
    )
    decode = start_server(
        model_dir, logs, *WORKER_FLAGS, "--disaggregation-mode", "decode", "--disagg-timeout", "30"
    )
    router = start_router(logs, [prefill.base_url], [decode.base_url])
    parts = {"prefill": prefill, "decode": decode, "router": router}
    yield parts
    for part in parts.values():
        part.stop()


def test_concurrent_requests_match_colocated_token_for_token(stack, colocated):
    _, expected = colocated
    router = stack["router"]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda p: complete(router.base_url, p, logprobs=1), prompts()))
    for i, response in enumerate(responses):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected[i], f"request {i}"
    streamed = httpx.post(
        f"{router.base_url}/v1/completions",
        json={
            "prompt": prompts()[7],
            "max_tokens": 12,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        },
        timeout=60,
    ).text
    assert streamed.rstrip().endswith("data: [DONE]")
    assert gauge(stack["decode"], "baton:disagg_transfers_total") >= 17
    for worker in (stack["prefill"], stack["decode"]):  # the handover latency histogram
        count = gauge(worker, "baton:disagg_transfer_latency_seconds_count")
        assert count >= 17 and gauge(worker, "baton:disagg_transfer_latency_seconds_sum") > 0
        assert gauge(worker, "baton:disagg_transfer_latency_seconds_bucket", le="+Inf") == count
    for worker in (stack["prefill"], stack["decode"]):
        assert pools_return_to_zero(worker) == [0, 0], worker.base_url


def test_logit_bias_reaches_both_halves(stack, colocated):
    """The prefill worker samples the first token, the decode worker the rest: a sampled request
    with a bias (seeded, so a rerun repeats it) gives the colocated server's text."""
    server, _ = colocated
    body = {"logit_bias": {"11": 6.0, "12": -100}, "temperature": 0.8, "seed": 3}
    want = complete(server.base_url, prompts()[5], **body).json()["choices"][0]["text"]
    got = complete(stack["router"].base_url, prompts()[5], **body)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == want
    refused = complete(stack["router"].base_url, prompts()[5], logit_bias={"x": 1})
    assert refused.status_code == 400 and "logit_bias" in refused.json()["error"]["message"]


def test_echo_through_the_pair(stack, colocated):
    """echo's text is the colocated server's. Scoring (echo with logprobs: the prompt's logprobs,
    which no handover carries) goes to the prefill worker whole, streamed or not, and gives the
    colocated answer; a room request asking for it directly is a 400 naming echo."""
    server, _ = colocated
    router = stack["router"].base_url
    want = complete(server.base_url, prompts()[3], echo=True).json()["choices"][0]["text"]
    got = complete(router, prompts()[3], echo=True)
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == want
    scoring = {"echo": True, "logprobs": 1, "max_tokens": 0}
    for prompt in (prompts()[3], prompts()[6]):
        want = complete(server.base_url, prompt, **scoring).json()["choices"][0]
        got = complete(router, prompt, **scoring)
        assert got.status_code == 200, got.text
        got = got.json()["choices"][0]
        assert (
            got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        )
        assert got["logprobs"]["token_logprobs"][0] is None
        assert got["logprobs"]["token_logprobs"][1:] == pytest.approx(
            want["logprobs"]["token_logprobs"][1:], abs=1e-5
        )
    streamed = httpx.post(
        f"{router}/v1/completions",
        json={"prompt": prompts()[3], "stream": True, **scoring},
        timeout=60,
    ).text
    assert streamed.count("data: ") == 2 and streamed.rstrip().endswith("data: [DONE]")
    direct = complete(
        stack["prefill"].base_url, prompts()[3], baton_disagg={"room": "r1"}, **scoring
    )
    assert direct.status_code == 400 and direct.json()["error"]["param"] == "echo"


def test_sglang_generate_through_the_pair(stack, colocated):
    """SGLang's /generate is split like a completion: the pair's tokens are the colocated
    server's, streamed (whole text so far per chunk) and not."""
    server, _ = colocated
    body = {"input_ids": prompts()[5], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    want = httpx.post(f"{server.base_url}/generate", json=body, timeout=60).json()
    got = httpx.post(f"{stack['router'].base_url}/generate", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["output_ids"] == want["output_ids"] and got.json()["text"] == want["text"]
    streamed = httpx.post(
        f"{stack['router'].base_url}/generate", json={**body, "stream": True}, timeout=60
    ).text
    events = [e.removeprefix("data: ") for e in streamed.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["text"] == want["text"]
    refused = httpx.post(
        f"{stack['router'].base_url}/generate", json={"text": "a", "input_ids": [5]}, timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "text"
    # logprobs: the output's through the split pair, the prompt's from a prefill worker whole
    for extra in ({"return_logprob": True}, {"return_logprob": True, "logprob_start_len": 0}):
        want = httpx.post(f"{server.base_url}/generate", json={**body, **extra}, timeout=60)
        got = httpx.post(f"{stack['router'].base_url}/generate", json={**body, **extra}, timeout=60)
        assert got.status_code == 200, got.text
        want, got = want.json()["meta_info"], got.json()["meta_info"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            assert [e[1] for e in got[key]] == [e[1] for e in want[key]], key
            assert [e[0] for e in got[key]] == pytest.approx([e[0] for e in want[key]], abs=1e-5)
        assert len(got["input_token_logprobs"]) == (
            len(body["input_ids"]) if extra.get("logprob_start_len") == 0 else 0
        )


def test_router_answers_models_retrieve_and_version(stack, model_dir):
    router = stack["router"].base_url
    card = httpx.get(f"{router}/v1/models/{model_dir}", timeout=10)
    assert card.status_code == 200 and card.json()["id"] == str(model_dir)
    # %3F stays a character of the id (not a query that would turn it into the list)
    other = httpx.get(f"{router}/v1/models/other%3Fx", timeout=10)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert "other?x" in other.json()["error"]["message"]
    assert httpx.get(f"{router}/version", timeout=10).json()["version"]


def test_pickle_on_the_transfer_socket_is_rejected_and_harmless(stack):
    info = httpx.get(f"{stack['prefill'].base_url}/disagg/info", timeout=10).json()
    context = zmq.Context.instance()
    sock = context.socket(zmq.DEALER)
    sock.connect(info["transfer_addr"])

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch /tmp/baton-pickle-pwned",))

    sock.send_multipart([pickle.dumps(Exploit()), b""])
    time.sleep(0.5)
    sock.close(linger=0)
    assert not os.path.exists("/tmp/baton-pickle-pwned")
    assert "rejected a message" in stack["prefill"].log()
    assert complete(stack["router"].base_url, [5, 6, 7]).status_code == 200


def test_router_refuses_a_client_room_and_reports_health(stack):
    router = stack["router"]
    assert httpx.get(f"{router.base_url}/health", timeout=10).status_code == 200
    assert httpx.get(f"{router.base_url}/v1/models", timeout=10).json()["data"]
    body = {
        "prompt": [5, 6, 7],
        "max_tokens": 3,
        "temperature": 0,
        "baton_disagg": {"room": "evil", "prefill_addr": "tcp://10.0.0.1:1"},
    }
    assert httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=30).status_code == 200


def test_killed_decode_worker_errors_the_stream_then_recovers(stack, model_dir, logs):
    router, decode = stack["router"], stack["decode"]
    events: list[str] = []
    done = threading.Event()

    def stream():
        body = {
            "prompt": [5, 6, 7, 8],
            "max_tokens": 3000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        try:
            with httpx.stream(
                "POST", f"{router.base_url}/v1/completions", json=body, timeout=30
            ) as response:
                for line in response.iter_lines():
                    if line:
                        events.append(line)
        except httpx.HTTPError as error:
            events.append(f"transport error: {error}")
        done.set()

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.time() + 60
    while len(events) < 3 and time.time() < deadline:
        time.sleep(0.05)
    assert len(events) >= 3, "the stream never started"
    os.kill(decode.process.pid, signal.SIGKILL)
    for pid in _children(decode.process.pid):
        os.kill(pid, signal.SIGKILL)
    killed = time.time()
    assert done.wait(10), "the client hung after the decode worker died"
    assert time.time() - killed < 10
    # As vLLM ends a failed stream: the error event, then [DONE].
    assert events[-1] == "data: [DONE]" and "error" in events[-2], events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and error["type"] == "service_unavailable", error
    # New requests fail fast with a clean 503 while no decode worker is healthy.
    start = time.time()
    while True:
        response = complete(router.base_url, [5, 6], max_tokens=2, timeout=10)
        if response.status_code == 503:
            break
        assert time.time() - start < 10
        time.sleep(0.2)
    assert "error" in response.json()
    # A decode worker started again on the same port brings the pair back.
    stack["decode"] = start_server(
        model_dir,
        logs,
        *WORKER_FLAGS,
        "--disaggregation-mode",
        "decode",
        "--disagg-timeout",
        "30",
        port=decode.port,
    )
    deadline = time.time() + 30
    while httpx.get(f"{router.base_url}/health", timeout=5).status_code != 200:
        assert time.time() < deadline
        time.sleep(0.2)
    assert complete(router.base_url, [5, 6, 7]).status_code == 200


def test_killed_prefill_worker_fails_pending_rooms_and_frees_them(stack):
    prefill, decode = stack["prefill"], stack["decode"]
    info = httpx.get(f"{prefill.base_url}/disagg/info", timeout=10).json()
    result: dict = {}

    def pending():
        # A room whose prefill never comes: the decode worker holds pages and a slot for it.
        body = {
            "prompt": list(range(3, 60)),
            "max_tokens": 5,
            "temperature": 0,
            "baton_disagg": {"room": "orphan", "prefill_addr": info["transfer_addr"]},
        }
        start = time.time()
        result["response"] = httpx.post(f"{decode.base_url}/v1/completions", json=body, timeout=60)
        result["seconds"] = time.time() - start

    thread = threading.Thread(target=pending)
    thread.start()
    time.sleep(1.0)
    assert gauge(decode, "baton:kv_pages_used") > 0
    os.kill(prefill.process.pid, signal.SIGKILL)
    for pid in _children(prefill.process.pid):
        os.kill(pid, signal.SIGKILL)
    thread.join(30)
    response = result["response"]
    # Not the client's fault: 503 in the OpenAI shape, naming the cause.
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert "stopped answering" in error["message"] and error["type"] == "service_unavailable"
    # The dropped connection caught it, not the lease (30 s) nor the transfer timeout.
    assert result["seconds"] < 20
    assert pools_return_to_zero(decode) == [0, 0]
    assert httpx.get(f"{decode.base_url}/health", timeout=10).status_code == 200


def test_injected_transfer_drops_fail_cleanly(model_dir, logs, colocated, monkeypatch):
    _, expected = colocated
    monkeypatch.setenv("BATON_FAULT_DROP_TRANSFER", "0.1")
    prefill = start_server(
        model_dir, logs, *WORKER_FLAGS, "--disaggregation-mode", "prefill", "--disagg-timeout", "4"
    )
    monkeypatch.delenv("BATON_FAULT_DROP_TRANSFER")
    decode = start_server(
        model_dir, logs, *WORKER_FLAGS, "--disaggregation-mode", "decode", "--disagg-timeout", "4"
    )
    # Retries off: the failures must reach the client here (the router would try again).
    router = start_router(logs, [prefill.base_url], [decode.base_url], "--retry-max-retries", "0")
    try:
        work = [(i % 16, prompts()[i % 16]) for i in range(60)]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            responses = list(
                pool.map(lambda item: (item[0], complete(router.base_url, item[1])), work)
            )
        ok = failed = 0
        for index, response in responses:
            if response.status_code == 200:
                assert response.json()["choices"][0]["text"] == expected[index]
                ok += 1
            else:
                message = response.json()["error"]["message"]
                assert response.status_code == 503, (response.status_code, message)
                assert "transfer failed" in message, message
                failed += 1
        assert failed > 0 and ok > 0, (ok, failed)
        dropped = gauge(prefill, "baton:disagg_transfers_failed_total")
        # every drop failed its request (timeouts under load may add more)
        assert 1 <= dropped <= failed, (dropped, failed)
        for worker in (prefill, decode, router):
            assert httpx.get(f"{worker.base_url}/health", timeout=10).status_code == 200
        for worker in (prefill, decode):
            assert pools_return_to_zero(worker) == [0, 0], worker.base_url
    finally:
        for part in (router, decode, prefill):
            part.stop()


def test_handshake_rejects_a_decode_worker_with_another_dtype(model_dir, logs):
    prefill = start_server(
        model_dir, logs, *WORKER_FLAGS, "--disaggregation-mode", "prefill", "--disagg-timeout", "10"
    )
    decode = start_server(
        model_dir, logs, *WORKER_FLAGS, "--disaggregation-mode", "decode", "--dtype", "bfloat16"
    )
    router = start_router(logs, [prefill.base_url], [decode.base_url])
    try:
        response = complete(router.base_url, [5, 6, 7, 8], max_tokens=4)
        assert response.status_code == 503  # a misconfigured pair: not the client's fault
        message = response.json()["error"]["message"]
        assert "dtype differs" in message and "float32" in message and "bfloat16" in message
        assert pools_return_to_zero(decode) == [0, 0]
    finally:
        for part in (router, decode, prefill):
            part.stop()


def _children(pid: int) -> list[int]:
    from tests.server_process import children_of

    try:
        return children_of(pid)
    except FileNotFoundError:
        return []
