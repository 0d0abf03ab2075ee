"""Retries and circuits, in process against fake workers: a request that failed before any byte
reached the client is tried on another pair, bounded; a worker that keeps failing is left alone,
then tried again; the client never sees a failed try."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import httpx
import pytest

from baton.server.router.app import DEFAULT_ROUTING, build_router_app
from baton.server.router.circuit import CircuitSettings
from tests.router_fakes import FakeWorker, Fleet, sse_events

FAST = dataclasses.replace(
    DEFAULT_ROUTING,
    retry=dataclasses.replace(DEFAULT_ROUTING.retry, initial_backoff_s=0.001, max_backoff_s=0.01),
)


async def serve(
    fleet: Fleet, scenario, routing=FAST, api_key: str | None = None, static: bool = True
):
    """Run `scenario(app, client)` against a router in front of the fleet (`static`: its
    workers given on the command line; else none, for discovery to find)."""
    prefill, decode = (fleet.urls("prefill"), fleet.urls("decode")) if static else ([], [])
    app = build_router_app(prefill, decode, api_key, routing=routing, transport=fleet)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://router.test", timeout=10
        ) as client:
            return await scenario(app, client)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


COMPLETION = {"prompt": "hi", "max_tokens": 3}
CHAT_STREAM = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}


@pytest.mark.parametrize("failure", ["refused", "503"])
def test_a_prefill_worker_that_fails_is_retried_on_another_and_the_client_sees_success(failure):
    fleet = Fleet(
        p1=FakeWorker("prefill", behaviour=failure),
        p2=FakeWorker("prefill"),
        d1=FakeWorker("decode"),
    )

    async def scenario(app, client):
        answers = [await client.post("/v1/completions", json=COMPLETION) for _ in range(4)]
        assert [a.status_code for a in answers] == [200] * 4
        assert all(a.json()["choices"][0]["text"] == " t0 t1 t2" for a in answers)
        assert fleet.served("p2") == 4 and fleet.served("d1") >= 4
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "baton:router_retries_total", worker=Fleet.url("p1")) >= 1
        assert metric(metrics, "baton:router_requests_total", status="200") == 4

    asyncio.run(serve(fleet, scenario))


def test_a_stream_whose_handover_fails_before_its_first_token_is_retried_without_a_duplicate():
    """The decode worker opened the chat stream (the role chunk) and then failed the handover:
    the client gets one opener, then the other decode worker's tokens; nothing of the failed
    try."""
    fleet = Fleet(
        p1=FakeWorker("prefill"),
        d1=FakeWorker("decode", behaviour="error_event"),
        d2=FakeWorker("decode"),
    )

    async def scenario(app, client):
        for _ in range(2):
            answer = await client.post("/v1/chat/completions", json=CHAT_STREAM)
            assert answer.status_code == 200
            events = sse_events(answer.text)
            assert events[-1] == "[DONE]" and not any("error" in e for e in events)
            chunks = [json.loads(e)["choices"][0]["delta"] for e in events[:-1]]
            assert chunks == [{"role": "assistant", "content": ""}] + [
                {"content": f" t{i}"} for i in range(3)
            ]
        assert fleet.served("d1") >= 1 and fleet.served("d2") == 2  # every answer is d2's

    asyncio.run(serve(fleet, scenario))


def test_a_failure_after_the_first_token_is_not_retried_and_ends_the_stream_with_an_error():
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode", behaviour="drop_after_token"))
    body = dict(COMPLETION, stream=True)

    async def scenario(app, client):
        answer = await client.post("/v1/completions", json=body)
        events = sse_events(answer.text)
        assert json.loads(events[0])["choices"][0]["text"] == " t0"
        assert "failed mid-stream" in json.loads(events[1])["error"]["message"]
        assert events[2:] == ["[DONE]"]
        assert fleet.served("d1") == 1  # the client already had a token: never tried again

    asyncio.run(serve(fleet, scenario))


def test_a_client_error_is_answered_as_it_is_not_retried():
    fleet = Fleet(
        p1=FakeWorker("prefill", behaviour="400"), p2=FakeWorker("prefill"), d1=FakeWorker("decode")
    )

    async def scenario(app, client):
        answer = await client.post("/v1/completions", json=COMPLETION)
        assert answer.status_code == 400
        assert "prefill worker says 400" in answer.json()["error"]["message"]
        assert fleet.served("p1") == 1 and fleet.served("p2") == 0

    asyncio.run(serve(fleet, scenario))


def test_retries_are_bounded_and_the_last_failure_is_the_answer():
    fleet = Fleet(
        p1=FakeWorker("prefill", behaviour="503"),
        p2=FakeWorker("prefill", behaviour="503"),
        d1=FakeWorker("decode"),
    )

    async def scenario(app, client):
        answer = await client.post("/v1/completions", json=COMPLETION)
        assert answer.status_code == 503
        assert "prefill worker says 503" in answer.json()["error"]["message"]
        retry = FAST.retry
        assert fleet.served("p1") + fleet.served("p2") == retry.max_retries + 1
        assert app.state.workers.running == 0

    asyncio.run(serve(fleet, scenario))


def test_a_worker_that_keeps_failing_is_opened_as_a_circuit_and_probed_back():
    routing = dataclasses.replace(FAST, circuit=CircuitSettings(failure_threshold=2, open_s=0.3))
    fleet = Fleet(
        p1=FakeWorker("prefill", behaviour="503"), p2=FakeWorker("prefill"), d1=FakeWorker("decode")
    )

    async def scenario(app, client):
        for _ in range(6):  # round robin tries p1 every other request, until it is open
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert fleet.served("p1") == 2  # opened after its second failure in a row
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "baton:router_circuit_open", worker=Fleet.url("p1")) == 1
        assert metric(metrics, "baton:router_open_circuits", role="prefill") == 1
        fleet.workers[Fleet.url("p1")].behaviour = "ok"  # it recovers meanwhile
        await asyncio.sleep(0.35)  # half-open: one trial request reaches it, and closes it
        for _ in range(4):
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        assert fleet.served("p1") == 4  # the trial, then its turns again
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "baton:router_open_circuits", role="prefill") == 0

    asyncio.run(serve(fleet, scenario, routing=routing))


def test_without_retries_the_first_failure_is_the_answer():
    routing = dataclasses.replace(FAST, retry=dataclasses.replace(FAST.retry, max_retries=0))
    fleet = Fleet(
        p1=FakeWorker("prefill", behaviour="refused"),
        p2=FakeWorker("prefill"),
        d1=FakeWorker("decode"),
    )

    async def scenario(app, client):
        answer = await client.post("/v1/completions", json=COMPLETION)
        assert answer.status_code == 503 and "ConnectError" in answer.json()["error"]["message"]
        assert fleet.served("p2") == 0

    asyncio.run(serve(fleet, scenario, routing=routing))


def test_when_every_circuit_of_a_side_is_open_its_workers_are_still_tried():
    """A circuit moves requests to other workers; it never refuses one a worker might serve."""
    routing = dataclasses.replace(FAST, circuit=CircuitSettings(failure_threshold=1, open_s=60))
    fleet = Fleet(p1=FakeWorker("prefill", behaviour="503"), d1=FakeWorker("decode"))

    async def scenario(app, client):
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 503
        assert app.state.workers.prefill[0].circuit.state() == "open"
        fleet.workers[Fleet.url("p1")].behaviour = "ok"
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200

    asyncio.run(serve(fleet, scenario, routing=routing))


def test_a_failed_handover_is_the_prefill_workers_when_its_half_fails_too():
    """A prefill worker that dies fails the handover on the decode side first: the failure is
    counted as the prefill worker's, and the healthy decode worker's circuit stays closed."""
    routing = dataclasses.replace(FAST, circuit=CircuitSettings(failure_threshold=1, open_s=60))
    fleet = Fleet(
        p1=FakeWorker("prefill", behaviour="dies"),
        p2=FakeWorker("prefill"),
        d1=FakeWorker("decode"),
    )
    body = dict(COMPLETION, stream=True)

    async def scenario(app, client):
        answer = await client.post("/v1/completions", json=body)
        assert [json.loads(e)["choices"][0]["text"] for e in sse_events(answer.text)[:-1]] == [
            " t0",
            " t1",
            " t2",
        ]
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "baton:router_retries_total", worker=Fleet.url("p1")) == 1
        assert metric(metrics, "baton:router_retries_total", worker=Fleet.url("d1")) == 0
        assert app.state.workers.decode[0].circuit.state() == "closed"

    asyncio.run(serve(fleet, scenario, routing=routing))
