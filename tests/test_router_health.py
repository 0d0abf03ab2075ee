"""The router's health probes and admission limit, in process, against fake workers
(an httpx transport), so each rule is tested alone and fast."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from baton.server.router.app import DEFAULT_ROUTING, build_router_app
from baton.server.router.policies.round_robin import RoundRobin
from baton.server.router.workers import FAILURES_TO_REMOVE, WorkerSet
from tests.router_fakes import MODEL

PREFILL, DECODE = "http://prefill.test", "http://decode.test"


class FakeWorkers(httpx.AsyncBaseTransport):
    """Both workers: `/health` answers per `health[url]` ("ok", "slow", "refused", "503"),
    generation requests wait until `release` is set, then answer a completion."""

    def __init__(self) -> None:
        self.health = {PREFILL: "ok", DECODE: "ok"}
        self.release = asyncio.Event()
        self.generations = 0
        self.gone: set[str] = set()  # workers whose generation requests are refused
        self.prefill_refuses: tuple[int, str] | None = None  # (status, message), at once
        self.prefill_refusal_param: str | None = None  # the refusal's `param`
        self.cancelled: list[str] = []  # workers whose generation request was cancelled
        self.crash = False  # generation requests raise an error that is no transport error

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}"
        path = request.url.path
        if path == "/health":
            mode = self.health[origin]
            if mode == "refused":
                raise httpx.ConnectError("connection refused", request=request)
            if mode == "slow":
                raise httpx.ReadTimeout("timed out", request=request)
            return httpx.Response(503 if mode == "503" else 200, json={})
        if path == "/disagg/info":
            info = {"role": "prefill" if origin == PREFILL else "decode", "transfer_addr": None}
            if origin == PREFILL:
                info["transfer_addr"] = "tcp://127.0.0.1:1"
            info |= {"page_size": 16, "track_interval": 64, "model": MODEL}
            return httpx.Response(200, json=info)
        self.generations += 1
        if self.crash:
            raise RuntimeError("a bug in the router's path")
        if origin in self.gone:
            raise httpx.ConnectError("connection refused", request=request)
        if origin == PREFILL and self.prefill_refuses is not None:
            status, message = self.prefill_refuses
            error = {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "service_unavailable",
                "param": self.prefill_refusal_param,
                "code": status,
            }
            return httpx.Response(status, json={"error": error})
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.append(origin)
            raise
        body = {"choices": [{"text": "ok", "index": 0}], "object": "text_completion"}
        return httpx.Response(200, json=body)


def worker_set(fake: FakeWorkers) -> WorkerSet:
    workers = WorkerSet(
        max_concurrent_requests=8,
        probe_client=httpx.AsyncClient(transport=fake),
        policies={"prefill": RoundRobin(), "decode": RoundRobin()},
        circuit=DEFAULT_ROUTING.circuit,
    )
    workers.add(PREFILL, "prefill")
    workers.add(DECODE, "decode")
    return workers


def transitions(workers: WorkerSet, state: str) -> float:
    text = workers.metrics.render().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "baton:router_worker_transitions_total"
        and sample.labels["state"] == state
    )


def test_slow_probes_take_a_worker_out_only_after_several_in_a_row():
    async def scenario():
        fake = FakeWorkers()
        workers = worker_set(fake)
        await workers.probe_all()
        assert workers.ready
        fake.health[DECODE] = "slow"
        for _ in range(FAILURES_TO_REMOVE - 1):
            await workers.probe_all()
        assert workers.ready and transitions(workers, "unhealthy") == 0
        fake.health[DECODE] = "ok"  # one good answer resets the count
        await workers.probe_all()
        fake.health[DECODE] = "slow"
        for _ in range(FAILURES_TO_REMOVE - 1):
            await workers.probe_all()
        assert workers.ready
        await workers.probe_all()
        assert not workers.ready and transitions(workers, "unhealthy") == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("failure", ["refused", "503"])
def test_a_refused_connection_or_a_503_takes_a_worker_out_at_once_and_one_pass_puts_it_back(
    failure,
):
    async def scenario():
        fake = FakeWorkers()
        workers = worker_set(fake)
        await workers.probe_all()
        fake.health[PREFILL] = failure
        await workers.probe_all()
        assert not workers.ready
        assert workers.prefill[0].transfer_addr is None  # relearnt when it comes back
        fake.health[PREFILL] = "ok"
        await workers.probe_all()
        assert workers.ready and workers.prefill[0].transfer_addr == "tcp://127.0.0.1:1"
        assert transitions(workers, "unhealthy") == 1

    asyncio.run(scenario())


NO_RETRIES = dataclasses.replace(
    DEFAULT_ROUTING, retry=dataclasses.replace(DEFAULT_ROUTING.retry, max_retries=0)
)


async def _router_client(fake: FakeWorkers, limit: int, routing=DEFAULT_ROUTING):
    app = build_router_app(
        [PREFILL], [DECODE], max_concurrent_requests=limit, transport=fake, routing=routing
    )
    return app, httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://router.test"
    )


def test_past_the_concurrency_limit_the_router_answers_429_with_retry_after():
    async def scenario():
        fake = FakeWorkers()
        app, client = await _router_client(fake, limit=3)
        async with app.router.lifespan_context(app), client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            running = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(3)
            ]
            while app.state.workers.running < 3:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/completions", json=body)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert "--max-concurrent-requests" in error["message"]
            # as OpenAI answers a rate limit
            assert (error["type"], error["param"], error["code"]) == (
                "requests",
                None,
                "rate_limit_exceeded",
            )
            fake.release.set()
            assert [r.status_code for r in await asyncio.gather(*running)] == [200] * 3
            # The places came back: the next request is admitted.
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert app.state.workers.running == 0
            metrics = (await client.get("/metrics")).text
            assert 'baton:router_requests_total{status="429"} 1.0' in metrics
            assert 'baton:router_requests_total{status="200"} 4.0' in metrics

    asyncio.run(scenario())


def test_request_traffic_that_finds_a_worker_gone_takes_it_out_at_once():
    async def scenario():
        fake = FakeWorkers()
        fake.release.set()
        fake.gone.add(DECODE)
        app, client = await _router_client(fake, limit=8)
        async with app.router.lifespan_context(app), client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            answer = await client.post("/v1/completions", json=body)
            assert answer.status_code == 503
            assert "ConnectError: connection refused" in answer.json()["error"]["message"]
            workers: WorkerSet = app.state.workers
            assert not workers.ready and transitions(workers, "unhealthy") == 1
            assert app.state.workers.running == 0

    asyncio.run(scenario())


def test_router_refuses_a_zero_concurrency_limit():
    from baton.server.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--prefill", PREFILL, "--decode", DECODE, "--max-concurrent-requests", "0"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status", [400, 503])
def test_a_failed_prefill_half_answers_at_once_and_cancels_the_decode_half(stream, status):
    """The decode half of a disaggregated request answers only once the prefill state arrives
    (a non-streaming one only when it is complete). When the prefill half fails, the client gets
    its error at once and the decode request is cancelled, instead of both waiting for the
    decode worker's transfer timeout (300 s by default). (Retries off: a 503 would be tried
    again, test_router_retries.py.)"""

    async def scenario():
        fake = FakeWorkers()
        fake.prefill_refuses = (status, "the prefill worker refused it")
        app, client = await _router_client(fake, limit=8, routing=NO_RETRIES)
        async with app.router.lifespan_context(app), client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2, "stream": stream}
            answer = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
            assert answer.status_code == status
            assert "the prefill worker refused it" in answer.json()["error"]["message"]
            assert fake.cancelled == [DECODE]
            assert app.state.workers.running == 0
            metrics = (await client.get("/metrics")).text
            assert f'baton:router_requests_total{{status="{status}"}} 1.0' in metrics

    asyncio.run(scenario())


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_refusal_reaches_the_client_with_its_param_and_code(stream):
    """A rule only a worker can apply (the vocabulary, the context) may be applied first by the
    prefill half: its 400 names the parameter as the worker's own answer does."""

    async def scenario():
        fake = FakeWorkers()
        fake.prefill_refuses = (400, "max_tokens (5000) exceeds max-model-len (2048)")
        fake.prefill_refusal_param = "max_tokens"
        app, client = await _router_client(fake, limit=8)
        async with app.router.lifespan_context(app), client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 5000, "stream": stream}
            answer = await asyncio.wait_for(client.post("/v1/completions", json=body), 10)
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["param"] == "max_tokens" and error["code"] == 400
            assert error["type"] == "invalid_request_error"
            assert "exceeds max-model-len (2048)" in error["message"]

    asyncio.run(scenario())


def test_an_error_nothing_handled_answers_an_openai_500_that_is_counted():
    """An exception no handler catches (a bug, not a worker's failure) answers a JSON 500 in the
    OpenAI shape, counted in the router's metrics, and gives its place back."""

    async def scenario():
        fake = FakeWorkers()
        fake.crash = True
        app, client = await _router_client(fake, limit=8)
        async with app.router.lifespan_context(app), client:
            body = {"model": "m", "prompt": "hi", "max_tokens": 2}
            answer = await client.post("/v1/completions", json=body)
            assert answer.status_code == 500
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == 500
            assert app.state.workers.running == 0
            metrics = (await client.get("/metrics")).text
            assert 'baton:router_requests_total{status="500"} 1.0' in metrics

    asyncio.run(scenario())
