"""Kubernetes service discovery against a stub API server (tests/stub_kubernetes.py) through
the official client: Ready pods become workers, their role from their selector or from their
/disagg/info, and pods that stop being ready or go away drain."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from baton.server.router.args import DiscoveryArgs
from tests.router_fakes import FakeWorker, Fleet
from tests.stub_kubernetes import StubKubernetes, pod
from tests.test_router_retries import COMPLETION, FAST, serve

PREFILL = {"app": "baton", "component": "prefill"}
WORKER = {"app": "baton", "component": "worker"}  # decode pods, found by --selector


async def until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


@pytest.fixture
def kubernetes(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with StubKubernetes() as stub:
        monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path)))
        yield stub


def test_pods_become_workers_and_drain_when_they_go(kubernetes):
    fleet = Fleet()
    # Pods are reached at http://POD_IP:8000; the fleet answers by host.
    fleet.workers["http://10.0.0.1"] = FakeWorker("prefill")
    fleet.workers["http://10.0.0.2"] = FakeWorker("decode")
    fleet.workers["http://10.0.0.3"] = FakeWorker("decode")
    fleet.workers["http://10.0.0.4"] = FakeWorker("prefill")
    kubernetes.put(pod("prefill-0", PREFILL, "10.0.0.1"))
    kubernetes.put(pod("decode-0", WORKER, "10.0.0.2"))
    kubernetes.put(pod("decode-1", WORKER, "10.0.0.3", ready=False))
    kubernetes.put(pod("elsewhere", PREFILL, "10.0.0.9", namespace="other"))
    routing = dataclasses.replace(
        FAST,
        discovery=DiscoveryArgs(
            selector=WORKER, prefill_selector=PREFILL, decode_selector={}, namespace="ns", port=8000
        ),
    )

    async def scenario(app, client):
        workers = app.state.workers
        await until(lambda: workers.ready and len(kubernetes.watches) == 2)
        assert [w.url for w in workers.prefill] == ["http://10.0.0.1:8000"]
        assert [(w.url, w.role) for w in workers.decode] == [("http://10.0.0.2:8000", "decode")]
        assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200

        kubernetes.put(pod("decode-1", WORKER, "10.0.0.3"))  # became Ready
        await until(lambda: len(workers.usable("decode")) == 2)
        kubernetes.put(pod("prefill-1", PREFILL, "10.0.0.4"))
        await until(lambda: len(workers.usable("prefill")) == 2)
        kubernetes.delete("prefill-0")
        await until(lambda: [w.url for w in workers.prefill] == ["http://10.0.0.4:8000"])
        kubernetes.put(pod("decode-0", WORKER, "10.0.0.2", ready=False))  # failing readiness
        await until(lambda: [w.url for w in workers.decode] == ["http://10.0.0.3:8000"])

        served = {url: len(w.requests) for url, w in fleet.workers.items()}
        for _ in range(3):
            assert (await client.post("/v1/completions", json=COMPLETION)).status_code == 200
        after = {url: len(w.requests) for url, w in fleet.workers.items()}
        grew = {url for url in after if after[url] > served[url]}
        assert grew == {"http://10.0.0.4", "http://10.0.0.3"}
        assert any(
            "labelSelector=app%3Dbaton%2Ccomponent%3Dprefill" in r for r in kubernetes.requests
        )

    asyncio.run(serve(fleet, scenario, routing=routing, static=False))
