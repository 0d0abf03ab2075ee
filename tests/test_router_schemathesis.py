"""schemathesis against the router, in process: the workers' own OpenAPI schema drives the
requests, the router (with fake workers that answer at once) must never answer 5xx to them.
test_server_schemathesis.py does the same to a live worker."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from fastapi.responses import JSONResponse
from hypothesis import HealthCheck, settings

from baton.server.app import build_app
from baton.server.args import DEFAULT_MAX_REQUEST_BYTES
from baton.server.router.app import build_router_app
from tests.test_router_health import DECODE, PREFILL, FakeWorkers

schemathesis = pytest.importorskip("schemathesis")


def worker_schema() -> dict:
    """The OpenAPI schema a worker serves (its routes only: no engine is started for it)."""
    state = SimpleNamespace(
        args=SimpleNamespace(max_request_bytes=DEFAULT_MAX_REQUEST_BYTES, api_key=None),
        metrics=SimpleNamespace(requests=None),
    )
    return build_app(state).openapi()


def router_serving(schema: dict):
    """The router app behind fake workers, probed once (both healthy), that also serves the
    workers' schema at /openapi.json. Its own lifespan is not run: schemathesis runs one per
    request, and the router's closes its HTTP clients at the end of each."""
    fake = FakeWorkers()
    fake.release.set()
    router = build_router_app([PREFILL], [DECODE], transport=fake)
    asyncio.run(router.state.workers.probe_all())
    assert router.state.workers.ready

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":  # schemathesis starts one per request: probed above
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
        elif scope["path"] == "/openapi.json":
            await JSONResponse(schema)(scope, receive, send)
        else:
            await router(scope, receive, send)

    return app


SCHEMA = schemathesis.openapi.from_asgi("/openapi.json", router_serving(worker_schema()))


@SCHEMA.include(method="POST").parametrize()
@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
def test_router_never_answers_a_server_error(case):
    response = case.call()
    case.validate_response(response, checks=[schemathesis.checks.not_a_server_error])
