"""The router against hostile input and misbehaving workers (issue 51), in process against fake
workers: the admin routes check and normalize worker URLs and never stop the health loop; a
worker's bodies are read within caps; a broken answer is a 502 counted on its circuit; a worker
that never sends its first byte fails the request at the deadline."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from baton.server.router.answers import HEALTH_BODY_BYTES, SMALL_BODY_BYTES
from baton.server.router.app import build_router_app
from baton.server.router.circuit import CircuitSettings
from baton.server.router.info import read_info
from baton.server.router.urls import worker_url
from baton.server.router.workers import FAILURES_TO_REMOVE, WorkerSet
from tests.router_fakes import MODEL, FakeWorker, Fleet, sse_events
from tests.test_router_health import worker_set
from tests.test_router_retries import COMPLETION, FAST, serve

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


def openai_error(answer: httpx.Response, status: int) -> dict:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


async def listed(client) -> dict[str, dict]:
    answer = await client.get("/workers", headers=AUTH)
    return {worker["url"]: worker for worker in answer.json()["workers"]}


async def until(condition, seconds: float = 10.0) -> None:
    """Wait (bounded) for an async condition."""
    for _ in range(int(seconds / 0.05)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


# -- URLs --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ("http://10.0.0.7:8000", "http://10.0.0.7:8000"),
        ("HTTP://Worker-1.Example:8000/", "http://worker-1.example:8000"),
        ("http://localhost:8100", "http://127.0.0.1:8100"),
        ("http://LOCALHOST.:8100/", "http://127.0.0.1:8100"),
        ("http://127.0.0.1:80", "http://127.0.0.1"),
        ("https://10.0.0.7:443/", "https://10.0.0.7"),
        ("http://[0:0::1]:8000", "http://[::1]:8000"),
        ("http://[::ffff:10.0.0.7]:8000", "http://10.0.0.7:8000"),
        ("http://h.test:08000", "http://h.test:8000"),
    ],
)
def test_one_worker_has_one_spelling(written, canonical):
    assert worker_url(written) == canonical


BAD_URLS = [
    ("http://127.0.0.1:99999", "port"),
    ("http://127.0.0.1:0", "port"),
    ("http://127.0.0.1:+80", "port"),
    ("http://127.0.0.1:8000\r\nX-Injected: 1", "position 21"),
    ("http://127.0.0.1:8000\n", "position 21"),
    (" http://127.0.0.1:8000", "position 0"),
    ("http://127.0.0.1:8000\x00", "position 21"),
    ("http://wörker:8000", "non-ASCII"),
    ("ftp://127.0.0.1:8000", "scheme"),
    ("file:///etc/passwd", "scheme"),
    ("127.0.0.1:8000", "scheme"),
    ("http://user:pw@127.0.0.1:8000", "user info"),
    ("http://127.0.0.1:8000/v1", "path"),
    ("http://127.0.0.1:8000?x=1", "query"),
    ("http://127.0.0.1:8000#top", "fragment"),
    ("http://:8000", "no host"),
    ("http://127.1:8000", "IPv4"),
    ("http://2130706433:8000", "IPv4"),
    ("http://[fe80::1%25eth0]:8000", "IPv6"),
    ("http://under_score-.example:8000", "host name"),
    ("http://xn--zz.example:8000", "A-label"),
    ("http://a..b:8000", "host name"),
    ("http://" + "a" * 64 + ".example", "host name"),
    (5, "string"),
    (None, "string"),
]


@pytest.mark.parametrize(("url", "named"), BAD_URLS)
def test_the_admin_route_refuses_what_is_not_a_workers_base_url_and_adds_nothing(url, named):
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode"))

    async def scenario(app, client):
        for role in (None, "decode"):
            body = {"url": url} | ({"role": role} if role else {})
            error = openai_error(await client.post("/workers", json=body, headers=AUTH), 400)
            assert error["param"] == "url" and named in error["message"], error
            assert error["type"] == "invalid_request_error"
        if isinstance(url, str):
            gone = await client.delete("/workers", params={"url": url}, headers=AUTH)
            assert named in openai_error(gone, 400)["message"]
        assert set(await listed(client)) == {Fleet.url("p1"), Fleet.url("d1")}

    asyncio.run(serve(fleet, scenario, api_key=KEY))


def test_a_bad_worker_url_on_the_command_line_names_its_flag():
    with pytest.raises(ValueError, match=r"--decode: .*port '99999'"):
        build_router_app(["http://127.0.0.1:8100"], ["http://127.0.0.1:99999"])


def test_one_worker_written_several_ways_is_one_worker():
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode"))

    async def scenario(app, client):
        fleet.workers["http://127.0.0.1"] = FakeWorker("decode")  # the fake keys on host only
        spellings = [
            "http://localhost:8123",
            "http://127.0.0.1:8123/",
            "HTTP://LocalHost:8123",
            "http://[::ffff:127.0.0.1]:8123",
        ]
        for url in spellings:
            added = await client.post("/workers", json={"url": url}, headers=AUTH)
            assert added.status_code == 200, added.text
            assert added.json()["url"] == "http://127.0.0.1:8123"
        for url in ("http://P1.TEST/", "http://p1.test:80"):
            again = await client.post("/workers", json={"url": url}, headers=AUTH)
            assert again.json()["url"] == Fleet.url("p1")
        workers = await listed(client)
        assert sorted(workers) == sorted(["http://127.0.0.1:8123", *map(Fleet.url, ["p1", "d1"])])
        removed = await client.delete(
            "/workers", params={"url": "http://LOCALHOST:8123/"}, headers=AUTH
        )
        assert removed.status_code == 200 and removed.json()["url"] == "http://127.0.0.1:8123"
        assert "http://127.0.0.1:8123" not in await listed(client)

    asyncio.run(serve(fleet, scenario, api_key=KEY))


def test_the_health_loop_outlives_refused_adds_and_deletes_and_still_sees_a_worker_die():
    """The probe's report: after a refused add of port 99999 or a CR/LF URL, the loop had
    stopped for good and a dead worker stayed healthy, also after a DELETE."""
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode"), d2=FakeWorker("decode"))

    async def scenario(app, client):
        for url in ("http://127.0.0.1:99999", "http://127.0.0.1:8000\r\nHost: evil"):
            for body in ({"url": url}, {"url": url, "role": "decode"}):
                answer = await client.post("/workers", json=body, headers=AUTH)
                openai_error(answer, 400)
        assert len(await listed(client)) == 3
        fleet.workers[Fleet.url("d1")].healthy = False  # dies after the refused adds

        async def d1_is_out() -> bool:
            return (await listed(client))[Fleet.url("d1")]["healthy"] is False

        await until(d1_is_out)
        deleted = await client.delete("/workers", params={"url": Fleet.url("d2")}, headers=AUTH)
        assert deleted.status_code == 200
        fleet.workers[Fleet.url("p1")].healthy = False  # dies after the DELETE

        async def p1_is_out() -> bool:
            return (await listed(client))[Fleet.url("p1")]["healthy"] is False

        await until(p1_is_out)
        assert (await client.get("/health")).status_code == 503
        fleet.workers[Fleet.url("p1")].healthy = True
        fleet.workers[Fleet.url("d1")].healthy = True

        async def ready() -> bool:
            return (await client.get("/health")).status_code == 200

        await until(ready)  # and back, by the same loop

    asyncio.run(serve(fleet, scenario, api_key=KEY))


def test_a_probe_that_fails_in_a_way_nobody_foresaw_is_a_failed_probe_not_a_dead_loop():
    class Buggy(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            if request.url.host == "prefill.test":
                raise RuntimeError("a bug under the probe")
            return httpx.Response(200, json={"status": "ok"})

    async def scenario() -> WorkerSet:
        workers = worker_set(Buggy())  # type: ignore[arg-type]
        workers.probe_client = httpx.AsyncClient(transport=Buggy())
        for _ in range(FAILURES_TO_REMOVE):
            await workers.probe_all()  # raises nothing
        return workers

    workers = asyncio.run(scenario())
    assert workers.prefill[0].failed_probes == FAILURES_TO_REMOVE
    assert workers.decode[0].failed_probes == FAILURES_TO_REMOVE  # /disagg/info "ok": no info


# -- bounded reads -----------------------------------------------------------------------------


class Gusher(httpx.AsyncBaseTransport):
    """Two workers whose /health (or /disagg/info) answers 200 with a 200 MB body, made lazily
    1 MiB at a time; counts the bytes the router actually pulled."""

    def __init__(self, path: str, claim_length: bool = False) -> None:
        self.path, self.claim_length, self.pulled = path, claim_length, 0

    async def _gush(self):
        for _ in range(200):
            self.pulled += 1 << 20
            yield b"x" * (1 << 20)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == self.path:
            headers = {"content-length": str(200 << 20)} if self.claim_length else {}
            return httpx.Response(200, headers=headers, content=self._gush())
        return httpx.Response(200, json={"status": "ok"})


@pytest.mark.parametrize("claim_length", [False, True])
def test_a_200_mb_health_body_is_cut_at_its_cap_and_fails_the_probe(claim_length):
    gusher = Gusher("/health", claim_length)

    async def scenario() -> WorkerSet:
        workers = worker_set(gusher)  # type: ignore[arg-type]
        workers.probe_client = httpx.AsyncClient(transport=gusher)
        for _ in range(FAILURES_TO_REMOVE):
            await workers.probe_all()
        return workers

    workers = asyncio.run(scenario())
    # at most one chunk past the cap per probe was ever pulled, never the 200 MB
    probes = 2 * FAILURES_TO_REMOVE
    assert gusher.pulled <= probes * (HEALTH_BODY_BYTES + (1 << 20))
    assert not claim_length or gusher.pulled == 0  # a claimed length past the cap: nothing read
    assert not any(w.healthy for w in workers.prefill + workers.decode)


def test_a_200_mb_disagg_info_is_cut_at_its_cap():
    gusher = Gusher("/disagg/info")

    async def scenario() -> None:
        workers = worker_set(gusher)  # type: ignore[arg-type]
        workers.probe_client = httpx.AsyncClient(transport=gusher)
        with pytest.raises(ValueError, match=f"more than the {SMALL_BODY_BYTES} bytes"):
            await read_info(workers.probe_client, "http://prefill.test")
        await workers.probe_all()
        assert not any(w.usable for w in workers.prefill + workers.decode)

    asyncio.run(scenario())
    assert gusher.pulled <= 3 * (SMALL_BODY_BYTES + (1 << 20))


def test_a_content_coded_answer_is_refused_not_inflated():
    class Zipped(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            return httpx.Response(200, headers={"content-encoding": "gzip"}, content=b"\x1f\x8b")

    async def scenario() -> None:
        workers = worker_set(Zipped())  # type: ignore[arg-type]
        workers.probe_client = httpx.AsyncClient(transport=Zipped())
        with pytest.raises(ValueError, match="Content-Encoding 'gzip'"):
            await read_info(workers.probe_client, "http://prefill.test")

    asyncio.run(scenario())


# -- broken answers ----------------------------------------------------------------------------

ONE_TRY_TRIPS = dataclasses.replace(
    FAST,
    retry=dataclasses.replace(FAST.retry, max_retries=0),
    circuit=CircuitSettings(failure_threshold=1, open_s=60.0),
)


@pytest.mark.parametrize("stream", [False, True])
def test_a_truncated_answer_is_a_502_that_opens_the_workers_circuit(stream):
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode", behaviour="truncated"))

    async def scenario(app, client):
        body = dict(COMPLETION, stream=stream)
        answer = await client.post("/v1/completions", json=body, headers=AUTH)
        error = openai_error(answer, 502)
        assert Fleet.url("d1") in error["message"] and error["type"] == "server_error"
        assert set(answer.json()) == {"error"}  # nothing of the broken answer but its name
        assert (await listed(client))[Fleet.url("d1")]["circuit"] == "open"

    asyncio.run(serve(fleet, scenario, routing=ONE_TRY_TRIPS, api_key=KEY))


def test_a_truncated_answer_is_retried_on_a_sound_pair():
    fleet = Fleet(
        p1=FakeWorker("prefill"),
        d1=FakeWorker("decode", behaviour="truncated"),
        d2=FakeWorker("decode"),
    )

    async def scenario(app, client):
        for _ in range(4):
            answer = await client.post("/v1/completions", json=COMPLETION, headers=AUTH)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["text"] == " t0 t1 t2"

    asyncio.run(serve(fleet, scenario, api_key=KEY))


class OddStream(httpx.AsyncBaseTransport):
    """A prefill and a decode worker; the decode worker streams one given event, then ends."""

    def __init__(self, event: bytes) -> None:
        self.event = event

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        role = "prefill" if request.url.host == "p1.test" else "decode"
        if request.url.path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if request.url.path == "/disagg/info":
            info = {"role": role, "page_size": 16, "track_interval": 64, "model": MODEL}
            return httpx.Response(200, json=info | {"transfer_addr": "tcp://p1.test:9"})
        if role == "prefill":
            return httpx.Response(200, json={"choices": [{"text": "", "index": 0}]})
        return httpx.Response(200, content=b"data: " + self.event + b"\n\n")


@pytest.mark.parametrize(
    ("event", "status"),
    [
        (b'{"object": "chat.completion.chunk", "choices": [1, 2]}', 502),
        (b'[{"choices": []}]', 502),
        (b"\xff\xfe not UTF-8", 502),
        (b'{"error": {"message": "fine, really", "code": 200}}', 502),
        (b'{"error": {"message": "handover failed", "code": 503}}', 503),
        (b"[" * 100_000, 502),
    ],
)
def test_a_first_stream_event_that_is_not_a_chunk_is_refused_in_the_openai_shape(event, status):
    fleet = OddStream(event)
    app = build_router_app(
        [Fleet.url("p1")], [Fleet.url("d1")], routing=ONE_TRY_TRIPS, transport=fleet
    )

    async def scenario() -> None:
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://router.test"
            ) as client:
                body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
                answer = await client.post("/v1/chat/completions", json=body)
                error = openai_error(answer, status)
                # the router's own words for a broken worker; a worker's 503 passes as it is
                named = Fleet.url("d1") if status == 502 else "handover failed"
                assert named in error["message"], error

    asyncio.run(scenario())


def test_a_workers_500_reaches_the_client_as_a_502_naming_it():
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode", behaviour="500"))

    async def scenario(app, client):
        answer = await client.post("/v1/completions", json=COMPLETION, headers=AUTH)
        error = openai_error(answer, 502)
        assert f"decode worker {Fleet.url('d1')} answered 500" in error["message"]

    asyncio.run(serve(fleet, scenario, api_key=KEY))


# -- the first-byte deadline ------------------------------------------------------------------

QUICK_DEADLINE = dataclasses.replace(ONE_TRY_TRIPS, first_byte_timeout_s=0.3)


@pytest.mark.parametrize(("stream", "hung"), [(False, "p1"), (True, "p1"), (True, "d1")])
def test_a_hung_worker_fails_the_request_at_the_first_byte_deadline(stream, hung):
    workers = {"p1": FakeWorker("prefill"), "d1": FakeWorker("decode")}
    workers[hung].behaviour = "hangs"
    fleet = Fleet(**workers)

    async def scenario(app, client):
        body = dict(COMPLETION, stream=stream)
        answer = await client.post("/v1/completions", json=body, headers=AUTH)
        error = openai_error(answer, 504)
        assert f"worker {Fleet.url(hung)} sent no first token within 0.3 s" in error["message"]
        assert "--worker-first-byte-timeout-secs" in error["message"]
        assert (await listed(client))[Fleet.url(hung)]["circuit"] == "open"
        await until(lambda: _true(workers[hung].abandoned == 1))  # its connection was closed

    asyncio.run(serve(fleet, scenario, routing=QUICK_DEADLINE, api_key=KEY))


async def _true(value: bool) -> bool:
    return value


def test_a_question_about_the_model_to_a_hung_decode_worker_ends_at_the_deadline():
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode", behaviour="hangs"))

    async def scenario(app, client):
        answer = await client.post("/tokenize", json={"prompt": "hi"}, headers=AUTH)
        assert "sent no answer within 0.3 s" in openai_error(answer, 504)["message"]

    asyncio.run(serve(fleet, scenario, routing=QUICK_DEADLINE, api_key=KEY))


def test_a_hung_prefill_worker_is_left_for_another_at_the_deadline():
    fleet = Fleet(
        p1=FakeWorker("prefill", behaviour="hangs"),
        p2=FakeWorker("prefill"),
        d1=FakeWorker("decode"),
    )
    routing = dataclasses.replace(FAST, first_byte_timeout_s=0.3)

    async def scenario(app, client):
        for stream in (False, True):
            body = dict(COMPLETION, stream=stream)
            answer = await client.post("/v1/completions", json=body, headers=AUTH)
            assert answer.status_code == 200, answer.text
            if stream:
                assert json.loads(sse_events(answer.text)[0])["choices"][0]["text"] == " t0"

    asyncio.run(serve(fleet, scenario, routing=routing, api_key=KEY))


def test_the_deadline_does_not_cut_a_non_streamed_answer_once_its_first_token_exists():
    """The prefill half answered in time: the decode worker may take longer than the deadline
    to complete its (non-streamed) answer."""
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode", answer_delay_s=0.8))

    async def scenario(app, client):
        answer = await client.post("/v1/completions", json=COMPLETION, headers=AUTH)
        assert answer.status_code == 200, answer.text

    asyncio.run(serve(fleet, scenario, routing=QUICK_DEADLINE, api_key=KEY))


def test_the_deadline_flag_refuses_what_is_not_a_positive_number():
    with pytest.raises(ValueError, match="--worker-first-byte-timeout-secs must be > 0"):
        dataclasses.replace(FAST, first_byte_timeout_s=0)
