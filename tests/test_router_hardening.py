"""The router against a real prefill + decode pair: it refuses what a worker would refuse before
dispatching anything, never answers 5xx to input, stays responsive under a huge prompt, aborts
both halves of a request whose client left, and guards its routes with the workers' key."""

from __future__ import annotations

import asyncio
import glob
import http.client
import json
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.disagg.address_token import vouch
from baton.server.args import SERVER_KEEP_ALIVE_S
from baton.server.router.app import ROUTER_KEEPALIVE_EXPIRY_S
from tests import zmtp
from tests.server_process import children_of, start_router, start_server, tiny_model
from tests.test_server_errors import LONE, assert_unending_headers_refused
from tests.test_server_load import TOKENIZED_WHOLE, HugeRequest, huge_prompt_body
from tests.test_server_up import environ

API_KEY = "sesame"
WORKER_SECRET = "worker-to-worker-secret-0123"
MODEL_NAME = "tiny"


def samples(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def total(server, name: str) -> float:
    return sum(value for (sample, _), value in samples(server).items() if sample == name)


def pools_in_use(worker) -> list[float]:
    values = samples(worker)
    return [values[(f"baton:{name}", ())] for name in ("kv_pages_used", "mamba_slots_used")]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    named = ("--served-model-name", MODEL_NAME)
    prefill = start_server(model_dir, logs, *named, "--disaggregation-mode", "prefill")
    decode = start_server(model_dir, logs, *named, "--disaggregation-mode", "decode")
    router = start_router(logs, [prefill.base_url], [decode.base_url])
    parts = {"prefill": prefill, "decode": decode, "router": router}
    yield parts
    for part in parts.values():
        part.stop()


def post_raw(router, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(
        f"{router.base_url}{path}",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=60,
    )


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", f'{{"prompt": {LONE}}}', "prompt"),
        ("/v1/completions", f'{{"prompt": "hi", "model": {LONE}}}', "model"),
        ("/v1/completions", f'{{"prompt": "hi", "user": {LONE}}}', "user"),
        ("/v1/completions", f'{{"prompt": "hi", "stop": [{LONE}], "stream": true}}', "stop"),
        ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": {LONE}}}]}}', "messages"),
        ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "hi"}]}', "messages"),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": "16"}', "max_tokens"),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": true}', "max_tokens"),
        ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "temperature": Infinity}', "temperature"),
        ("/v1/completions", '{"prompt": "hi", "top_p": 1e400}', "top_p"),
        ("/v1/completions", '{"prompt": "hi", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
        ("/v1/completions", '{"prompt": "hi", "max_tokens": -3}', "max_tokens"),
        ("/v1/completions", '{"prompt": "hi", "stream": true, "stream_options": 5}', "stream_options"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
    ],
)  # fmt: skip
def test_router_refuses_what_a_worker_would_with_400_before_dispatching(stack, path, raw, param):
    """One validation, the workers' own: a request either half would refuse never reaches a
    worker (its requests counter does not move), and no input gets a 5xx."""
    router, prefill, decode = stack["router"], stack["prefill"], stack["decode"]
    seen = {name: total(stack[name], "baton:requests_total") for name in ("prefill", "decode")}
    response = post_raw(router, path, raw.encode())
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    # A valid request after it: once it is counted, a dispatched invalid one would be too.
    barrier = httpx.post(
        f"{router.base_url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60
    )
    assert barrier.status_code == 200, barrier.text
    time.sleep(0.5)
    for name, worker in (("prefill", prefill), ("decode", decode)):
        assert total(worker, "baton:requests_total") == seen[name] + 1, name
    assert "Traceback" not in router.log()


def test_invalid_stream_options_never_start_a_prefill(stack):
    """The prefill half is sent without `stream_options`, so only the decode worker could see
    that they are invalid; the router must refuse them before it sends either half."""
    prefill = stack["prefill"]
    prompt_tokens = total(prefill, "baton:prompt_tokens_total")
    body = {
        "prompt": list(range(5, 100)),
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": "yes"},
    }
    response = httpx.post(f"{stack['router'].base_url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
    time.sleep(1.0)
    assert total(prefill, "baton:prompt_tokens_total") == prompt_tokens
    assert pools_in_use(prefill) == [0, 0]


def test_router_answers_413_over_max_request_bytes(stack):
    prefill = stack["prefill"]
    seen = total(prefill, "baton:requests_total")
    raw = b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    response = post_raw(stack["router"], "/v1/completions", raw)
    assert response.status_code == 413
    assert "--max-request-bytes" in response.json()["error"]["message"]
    assert total(prefill, "baton:requests_total") == seen


def test_a_huge_prompt_leaves_the_router_and_its_workers_responsive(stack):
    """Both workers tokenize the huge prompt in a thread: the router's probes keep passing (no
    worker is marked unhealthy) and another client's request succeeds meanwhile."""
    router = stack["router"]
    log_before = router.log()
    huge = HugeRequest(
        f"{router.base_url}/v1/completions", huge_prompt_body(None, **TOKENIZED_WHOLE)
    )
    huge.start()
    assert huge.sent.wait(120)
    health = httpx.get(f"{router.base_url}/health", timeout=600)
    other = httpx.post(
        f"{router.base_url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=600
    )
    other_before_huge = not huge.finished.is_set()
    huge.join(600)
    assert health.status_code == 200 and other.status_code == 200, other.text
    assert other_before_huge, "another client's request waited for the huge prompt"
    assert huge.response is not None and huge.response.status_code == 200, huge.response.text
    assert "unhealthy" not in router.log().removeprefix(log_before), router.log()[-2000:]


def test_clients_that_give_up_cost_few_tokens_and_free_both_halves(stack):
    """Non-streaming and streaming clients that hang up: the router aborts both halves."""
    router, decode = stack["router"], stack["decode"]
    before = total(decode, "baton:generation_tokens_total")
    long = {"prompt": "Once upon a time", "max_tokens": 2000, "extra_body": {"ignore_eos": True}}

    async def stream_forever(client) -> None:
        async with await client.completions.create(model=MODEL_NAME, stream=True, **long) as stream:
            async for _ in stream:
                pass

    async def give_up() -> None:
        async with openai.AsyncOpenAI(
            base_url=f"{router.base_url}/v1", api_key="none", max_retries=0, timeout=120
        ) as client:
            tasks = [
                *(asyncio.create_task(client.completions.create(model=MODEL_NAME, **long)) for _ in range(12)),
                *(asyncio.create_task(stream_forever(client)) for _ in range(4)),
            ]  # fmt: skip
            deadline = time.monotonic() + 60
            # Give up once every request is decoding (not on a clock a loaded machine can beat).
            while samples(decode)[("baton:num_requests_running", ())] < 16:
                assert time.monotonic() < deadline, "the 16 requests never all ran"
                await asyncio.sleep(0.05)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(give_up())
    deadline = time.monotonic() + 20
    while any(pools_in_use(w) != [0, 0] for w in (stack["prefill"], decode)):
        assert time.monotonic() < deadline, {
            n: pools_in_use(stack[n]) for n in ("prefill", "decode")
        }
        time.sleep(0.1)
    generated = total(decode, "baton:generation_tokens_total") - before
    assert generated < 16 * 2000 / 10, f"{generated:.0f} tokens: abandoned requests ran on"


def test_router_refuses_headers_that_never_end(stack):
    assert_unending_headers_refused(stack["router"])


def test_router_error_texts_name_the_cause():
    from baton.server.router.workers import describe

    assert "ReadError" in describe(httpx.ReadError(""))
    assert "RemoteProtocolError" in describe(httpx.RemoteProtocolError(""))
    assert "connection refused" in describe(httpx.ConnectError("connection refused"))


@pytest.fixture(scope="module")
def keyed_stack(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("keyed-logs")
    secret = ("--disagg-secret", WORKER_SECRET)
    prefill = start_server(
        model_dir, logs, *secret, "--disaggregation-mode", "prefill", api_key=API_KEY
    )
    decode = start_server(
        model_dir, logs, *secret, "--disaggregation-mode", "decode", api_key=API_KEY
    )
    router = start_router(logs, [prefill.base_url], [decode.base_url], api_key=API_KEY)
    parts = {"prefill": prefill, "decode": decode, "router": router}
    yield parts
    for part in parts.values():
        part.stop()


def test_keyed_router_reaches_keyed_workers_and_guards_its_routes(keyed_stack):
    """The router became healthy, so it sent its key to the workers' /disagg/info; the Bearer
    scheme is case-insensitive; /health stays open."""
    router = keyed_stack["router"]
    url = router.base_url
    info = httpx.get(f"{keyed_stack['prefill'].base_url}/disagg/info", timeout=10)
    assert info.status_code == 401  # the workers' /disagg/info follows their key
    body = {"prompt": [5, 6, 7], "max_tokens": 3}
    assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 401
    for scheme in ("Bearer", "bearer"):
        headers = {"Authorization": f"{scheme} {API_KEY}"}
        response = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.get(f"{url}/v1/models", headers=wrong, timeout=10).status_code == 401
    for path in ("/docs", "/openapi.json"):
        assert httpx.get(f"{url}{path}", timeout=10).status_code == 401, path
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert json.loads(httpx.get(f"{url}/health", timeout=10).text)["status"] == "ok"


def test_a_keyed_decode_worker_dials_only_addresses_a_prefill_worker_vouched_for(keyed_stack):
    """Issue 51's probe: a decode worker dialed any baton_disagg.prefill_addr a client sent.
    With a secret, the address must come with its prefill worker's token (its /disagg/info's,
    which the router passes on): a missing, another address's or a forged token is a 400 that
    names the field, before any engine work; the router's own requests still pass."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    prefill, decode = keyed_stack["prefill"], keyed_stack["decode"]
    info = httpx.get(f"{prefill.base_url}/disagg/info", headers=headers, timeout=10).json()
    address, token = info["transfer_addr"], info["transfer_addr_token"]
    assert token == vouch(WORKER_SECRET, address) and token != vouch("other", address)
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}
    elsewhere = "tcp://127.0.0.1:1"
    for disagg in (
        {"prefill_addr": elsewhere},
        {"prefill_addr": elsewhere, "prefill_addr_token": token},
        {"prefill_addr": address, "prefill_addr_token": "0" * 64},
        {"prefill_addr": address, "prefill_addr_token": token[:-1]},
    ):
        response = httpx.post(
            f"{decode.base_url}/v1/completions",
            json=body | {"baton_disagg": {"room": "probe", **disagg}},
            headers=headers,
            timeout=30,
        )
        assert response.status_code == 400, (disagg, response.text)
        error = response.json()["error"]
        assert error["param"] == "baton_disagg.prefill_addr_token", error
        assert "vouched" in error["message"]
    routed = httpx.post(
        f"{keyed_stack['router'].base_url}/v1/completions", json=body, headers=headers, timeout=60
    )
    assert routed.status_code == 200, routed.text


def test_secrets_given_to_a_worker_never_reach_its_engines_command_line(keyed_stack):
    """`ps` shows every command line to every local user: the secrets a worker was given go to
    its engine process in the environment (the engine's command line used to carry the worker
    secret, in its JSON spec)."""
    for role in ("prefill", "decode"):
        (engine,) = children_of(keyed_stack[role].process.pid)
        command = Path(f"/proc/{engine}/cmdline").read_bytes()
        assert b"baton.engine.runtime.process" in command or b"baton.disagg.process" in command
        assert WORKER_SECRET.encode() not in command and API_KEY.encode() not in command, role
        assert environ(engine)["BATON_DISAGG_SECRET"] == WORKER_SECRET, role


def _health_status(connection: http.client.HTTPConnection) -> int:
    connection.request("GET", "/health")
    response = connection.getresponse()
    response.read()
    return response.status


def test_servers_keep_idle_connections_longer_than_their_clients_do(stack):
    """A server that drops an idle connection at the instant its client reuses it loses that
    request in flight (uvicorn's 5 s default equals httpx's 5 s expiry: under load the router
    lost a prefill POST that way and the request waited out the 300 s transfer timeout). The
    router and the workers keep an idle connection past the router's own expiry (and so past
    httpx's 5 s default)."""
    assert ROUTER_KEEPALIVE_EXPIRY_S < SERVER_KEEP_ALIVE_S
    connections, sockets = {}, {}
    for name in ("router", "prefill", "decode"):
        url = httpx.URL(stack[name].base_url)
        connections[name] = http.client.HTTPConnection(url.host, url.port, timeout=10)
        assert _health_status(connections[name]) == 200
        sockets[name] = connections[name].sock
    time.sleep(ROUTER_KEEPALIVE_EXPIRY_S + 1)
    for name, connection in connections.items():
        # a connection the server closed meanwhile fails here (RemoteDisconnected)
        assert _health_status(connection) == 200, name
        assert connection.sock is sockets[name], name  # the same connection, not a new one
        connection.close()


def test_router_answers_tokenize_and_detokenize_as_its_workers_do(stack):
    """vLLM's /tokenize and /detokenize (DESIGN §9) through `baton up`'s front door too."""
    router, decode = stack["router"], stack["decode"]
    for path, body in (
        ("/tokenize", {"model": MODEL_NAME, "prompt": "Hello world"}),
        ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/detokenize", {"tokens": [5, 6, 7]}),
        ("/tokenize", {"model": "nope", "prompt": "a"}),
        ("/detokenize", {"tokens": [-1]}),
    ):
        through_router = httpx.post(f"{router.base_url}{path}", json=body, timeout=30)
        direct = httpx.post(f"{decode.base_url}{path}", json=body, timeout=30)
        assert through_router.status_code == direct.status_code, (path, body)
        assert through_router.json() == direct.json(), (path, body)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": 5000}, "max_tokens"),
        ({"prompt": "", "max_tokens": 2}, "prompt"),
        ({"prompt": "hi", "max_tokens": 2, "logit_bias": {"999999": 1}}, "logit_bias"),
        ({"prompt": "hi", "max_tokens": 2, "stream": True, "stop_token_ids": [999999]}, None),
    ],
    ids=repr,
)
def test_a_refusal_only_the_workers_can_make_keeps_its_param_through_the_router(stack, body, param):
    """Rules that need the model (vocabulary, context) are applied by the prefill worker, whose
    400 the router passes on: with the worker's `param` and `code`, not a bare message."""
    direct = httpx.post(f"{stack['decode'].base_url}/v1/completions", json=body, timeout=30)
    routed = httpx.post(f"{stack['router'].base_url}/v1/completions", json=body, timeout=30)
    assert routed.status_code == direct.status_code == 400, routed.text
    worker_error, router_error = direct.json()["error"], routed.json()["error"]
    assert router_error["param"] == worker_error["param"]
    assert param is None or router_error["param"] == param
    assert (
        router_error["code"] == worker_error["code"]
        and router_error["type"] == worker_error["type"]
    )
    assert worker_error["message"] in router_error["message"]


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v1/no-such-route", 404),
        ("GET", "/v1/completions", 405),
        ("DELETE", "/health", 405),
    ],
)
def test_router_answers_unknown_routes_in_the_workers_error_shape(stack, method, path, status):
    """A client sees one error shape from the router and from a worker (was FastAPI's
    {"detail": ...} from the router)."""
    for server in (stack["router"], stack["decode"]):
        response = httpx.request(method, f"{server.base_url}{path}", timeout=30)
        assert response.status_code == status, (server.base_url, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/tokenize", f'{{"prompt": {LONE}}}', "prompt"),
        ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, "x_unknown": {LONE}}}', "x_unknown"),
        ("/v1/completions", f'{{"prompt": "hi", "max_tokens": 2, {LONE}: 1}}', None),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,'
            f' "chat_template_kwargs": {{"enable_thinking": {LONE}}}}}',
            "chat_template_kwargs",
        ),
        ("/detokenize", f'{{"tokens": [5], "model": {LONE}}}', "model"),
    ],
    ids=["tokenize-prompt", "unknown-field", "unknown-key", "template-kwargs", "detokenize"],
)  # fmt: skip
def test_router_refuses_text_that_is_not_unicode_and_keeps_the_connection(stack, path, raw, param):
    """A lone surrogate in a field the router forwards without reading used to fail its UTF-8
    request to the worker: a plain-text 500, the connection closed under the client, the 500
    uncounted and "Task exception was never retrieved" in its log. Now: a 400 in the OpenAI
    shape, counted, and the same keep-alive connection serves the next request."""
    router = stack["router"]
    seen = samples(router).get(("baton:router_requests_total", (("status", "400"),)), 0.0)
    url = httpx.URL(router.base_url)
    connection = http.client.HTTPConnection(url.host, url.port, timeout=30)
    connection.request(
        "POST", path, body=raw.encode(), headers={"content-type": "application/json"}
    )
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 400, error
    assert (
        set(error) == {"message", "type", "param", "code"} and "lone surrogate" in error["message"]
    )
    assert param is None or error["param"] == param
    sock = connection.sock
    assert _health_status(connection) == 200 and connection.sock is sock  # same connection
    connection.close()
    counted = samples(router)[("baton:router_requests_total", (("status", "400"),))]
    assert counted == seen + 1
    assert "Task exception was never retrieved" not in router.log()
    assert "Traceback" not in router.log()


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) / 1024


def forge(address: str, claimed: bytes, messages: list[list[bytes]]) -> None:
    """Send `messages` to `address` as a `claimed` peer, reconnecting when libzmq drops the
    connection (it does when a part is over the socket's limit)."""
    sock = zmtp.connect(address, claimed)
    for parts in messages:
        data = b"".join(zmtp.frame(p, more=i < len(parts) - 1) for i, p in enumerate(parts))
        if not zmtp.send_all(sock, data):
            sock.close()
            sock = zmtp.connect(address, claimed)
    sock.close()


def test_forged_frames_to_every_bound_port_are_bounded_and_counted(stack):
    """Every ZMQ port a worker binds: the prefill transfer port (ROUTER), the decode worker's
    rank transfer port (PULL, bound at TP=1 too: a TP > 1 prefill peer sends to it), and each
    worker's ipc files (the server's PULL inbox and PUSH outbox). 16 MB frames (the decode
    engine used to keep every one it was sent: 20 raised it by 330 MB, for good) and junk
    messages: no process keeps more than 50 MB (8 such frames: 130 MB kept before), the junk
    (also a malformed frame at a server's ipc inbox, which used to stop its receive task for
    good) is counted, and the stack serves."""
    prefill, decode, router = stack["prefill"], stack["decode"], stack["router"]
    info = {
        role: httpx.get(f"{stack[role].base_url}/disagg/info", timeout=10).json()
        for role in ("prefill", "decode")
    }
    ipc = {
        role: sorted(glob.glob(f"{tempfile.gettempdir()}/baton-{stack[role].process.pid}-*"))
        for role in ("prefill", "decode")
    }
    pids = {}
    for role in ("prefill", "decode"):
        pids[f"{role} worker"] = stack[role].process.pid
        (pids[f"{role} engine"],) = children_of(stack[role].process.pid)
    before = {name: rss_mb(pid) for name, pid in pids.items()}
    refused = {
        "prefill": total(prefill, "baton:disagg_messages_refused_total"),
        "decode": total(decode, "baton:zmq_messages_refused_total"),
    }
    huge, junk = [[b"x" * (16 << 20)]] * 8, [[b"junk header", b"no mac"]] * 30
    # junk first: a frame over a socket's part bound drops the connection, and what was sent
    # on it after that is lost
    (rank_port,) = info["decode"]["rank_transfer_addrs"]
    forge(rank_port, b"PUSH", junk + [[b"p"] * 40] + huge)  # 40 parts: over the part count
    forge(info["prefill"]["transfer_addr"], b"DEALER", junk + [[b"p"] * 5] + huge)
    for role in ("prefill", "decode"):
        (inbox,) = (p for p in ipc[role] if p.endswith("-out"))  # the server's PULL
        (outbox,) = (p for p in ipc[role] if p.endswith("-in"))  # the server's PUSH
        # (junk only: the server's inbox has no part bound, engine_client.py says why)
        forge(f"ipc://{inbox}", b"PUSH", [[b"junk"]] * 10)
        forge(f"ipc://{outbox}", b"PULL", huge)
    body = {"prompt": [5, 6, 7], "max_tokens": 3}  # the stack serves, and engines report stats
    assert httpx.post(f"{router.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    time.sleep(2)
    after = {name: rss_mb(pid) for name, pid in pids.items()}
    grown = {name: after[name] - before[name] for name in pids}
    assert all(mb < 50 for mb in grown.values()), grown
    assert total(prefill, "baton:disagg_messages_refused_total") >= refused["prefill"] + 31
    # the decode engine's rank port (30 junk + 1 over the part count) and its server's ipc inbox
    assert total(decode, "baton:zmq_messages_refused_total") >= refused["decode"] + 31 + 10
