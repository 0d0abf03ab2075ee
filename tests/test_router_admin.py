"""Worker membership while the router serves, in process against fake workers: the admin routes
behind the router's key, a worker added mid-traffic, a removed one draining."""

from __future__ import annotations

import asyncio
import json

from tests.router_fakes import FakeWorker, Fleet, sse_events
from tests.test_router_retries import COMPLETION, metric, serve

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_the_admin_routes_need_the_routers_key():
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode"))

    async def unkeyed(app, client):
        for method in ("GET", "POST", "DELETE"):
            answer = await client.request(method, "/workers", params={"url": "http://x.test"})
            assert answer.status_code == 403, method
            assert "--api-key" in answer.json()["error"]["message"]

    async def keyed(app, client):
        assert (await client.get("/workers")).status_code == 401
        answer = await client.post("/workers", json={"url": "http://p9.test"})
        assert answer.status_code == 401 and len(app.state.workers.prefill) == 1
        listed = (await client.get("/workers", headers=AUTH)).json()["workers"]
        assert {(w["url"], w["role"], w["healthy"]) for w in listed} == {
            (Fleet.url("p1"), "prefill", True),
            (Fleet.url("d1"), "decode", True),
        }

    asyncio.run(serve(fleet, unkeyed))
    asyncio.run(serve(fleet, keyed, api_key=KEY))


def test_an_added_worker_learns_its_role_and_gets_requests_at_once():
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode"))

    async def scenario(app, client):
        fleet.add("d2", FakeWorker("decode"))
        added = await client.post("/workers", json={"url": Fleet.url("d2") + "/"}, headers=AUTH)
        assert added.status_code == 200, added.text
        assert added.json()["role"] == "decode" and added.json()["healthy"] is True
        for _ in range(4):
            answer = await client.post("/v1/completions", json=COMPLETION, headers=AUTH)
            assert answer.status_code == 200
        assert fleet.served("d1") == 2 and fleet.served("d2") == 2
        metrics = (await client.get("/metrics")).text
        assert metric(metrics, "baton:router_worker_requests_total", worker=Fleet.url("d2")) == 2

    asyncio.run(serve(fleet, scenario, api_key=KEY))


def test_admin_answers_name_what_is_wrong():
    fleet = Fleet(p1=FakeWorker("prefill"), d1=FakeWorker("decode"))

    async def scenario(app, client):
        cases = [
            ({"url": "p2.test:8000"}, 400, "url"),
            ({"url": 5}, 400, "url"),
            ({"url": "http://nowhere.test"}, 400, "role"),  # no role, and no /disagg/info
            ({"url": Fleet.url("p1"), "role": "decode"}, 409, "url"),
            ({"url": "http://p2.test", "role": "mixed"}, 400, "role"),
        ]
        for body, status, param in cases:
            answer = await client.post("/workers", json=body, headers=AUTH)
            assert answer.status_code == status, (body, answer.text)
            assert answer.json()["error"]["param"] == param
        gone = await client.delete("/workers", params={"url": "http://p7.test"}, headers=AUTH)
        assert gone.status_code == 404

    asyncio.run(serve(fleet, scenario, api_key=KEY))


def test_a_removed_worker_finishes_its_streams_and_gets_nothing_new():
    hold = asyncio.Event()
    fleet = Fleet(
        p1=FakeWorker("prefill"),
        d1=FakeWorker("decode", hold=hold),
        d2=FakeWorker("decode", hold=hold),
    )
    body = dict(COMPLETION, stream=True)

    async def scenario(app, client):
        streams = [
            asyncio.create_task(client.post("/v1/completions", json=body, headers=AUTH))
            for _ in range(2)
        ]
        d1 = fleet.workers[Fleet.url("d1")]
        while d1.streaming == 0 or fleet.workers[Fleet.url("d2")].streaming == 0:
            await asyncio.sleep(0.01)
        removed = await client.delete("/workers", params={"url": Fleet.url("d1")}, headers=AUTH)
        assert removed.json()["draining"] is True and removed.json()["requests_running"] == 1
        hold.set()
        for _ in range(3):  # nothing new reaches d1 from the moment it drains
            answer = await client.post("/v1/completions", json=COMPLETION, headers=AUTH)
            assert answer.status_code == 200
        assert fleet.served("d1") == 1
        for stream in await asyncio.gather(*streams):  # its stream finished, whole
            events = sse_events(stream.text)
            assert [json.loads(e)["choices"][0]["text"] for e in events[:-1]] == [
                " t0",
                " t1",
                " t2",
            ]
        listed = (await client.get("/workers", headers=AUTH)).json()["workers"]
        assert Fleet.url("d1") not in {w["url"] for w in listed}  # dropped once drained
        metrics = (await client.get("/metrics")).text
        assert f'worker="{Fleet.url("d1")}"' not in metrics

    asyncio.run(serve(fleet, scenario, api_key=KEY))
