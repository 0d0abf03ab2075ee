"""The router's admin routes: list, add and remove workers while it serves.

    GET    /workers               every worker: role, health, load, circuit, draining
    POST   /workers {"url": ..., "role": "prefill" | "decode"}   role optional: read from the
                                  worker's /disagg/info when omitted
    DELETE /workers?url=...       the worker drains: no new requests, in-flight ones finish

They change where traffic goes, so they exist only behind the router's `--api-key` (the key
middleware checks it before they run); without a key they answer 403. A URL is checked and made
canonical first (router/urls.py: 400 naming what is wrong, nothing added), so one worker written
two ways is one worker; a worker that serves another model than the others is refused (409
naming both models, nothing added).
"""

from __future__ import annotations

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from baton.server.errors import APIError
from baton.server.router.info import read_info
from baton.server.router.urls import worker_url
from baton.server.router.workers import Worker, WorkerSet, describe


def describe_worker(worker: Worker) -> dict:
    return {
        "url": worker.url,
        "role": worker.role,
        "healthy": worker.healthy,
        "draining": worker.draining,
        "requests_running": worker.in_flight,
        "circuit": worker.circuit.state(),
        "transfer_addr": worker.transfer_addr,
        "page_size": worker.info.page_size if worker.info is not None else None,
        "track_interval": worker.info.track_interval if worker.info is not None else None,
        "model": worker.info.model.name if worker.info is not None else None,
        "refused": worker.refused,
    }


def checked_url(value: object) -> str:
    try:
        return worker_url(value)
    except ValueError as error:
        raise APIError.bad_request(str(error), "url") from None


def admin_routes(workers: WorkerSet, api_key: str | None) -> APIRouter:
    router = APIRouter()

    def check_enabled() -> None:
        if not api_key:
            raise APIError(
                403,
                "the worker admin routes need the router to run with --api-key",
                None,
            )

    @router.get("/workers")
    async def list_workers() -> dict:
        check_enabled()
        return {"workers": [describe_worker(w) for w in workers.prefill + workers.decode]}

    @router.post("/workers")
    async def add_worker(request: Request) -> Response:
        check_enabled()
        body = getattr(request.state, "json_body", None)  # parsed by RequestBodyMiddleware
        if not isinstance(body, dict):
            raise APIError.bad_request("body must be a JSON object with url (and role)", None)
        url = checked_url(body.get("url"))
        role = body.get("role")
        if role not in (None, "prefill", "decode"):
            raise APIError.bad_request(
                f"role must be prefill or decode, got {role!r}"[:300], "role"
            )
        if role is None:
            try:
                info = await read_info(workers.probe_client, url)
            except (httpx.HTTPError, ValueError) as error:
                raise APIError.bad_request(
                    f"no role given and {url}/disagg/info could not be read "
                    f"({describe(error)}); pass role",
                    "role",
                ) from None
            if (refusal := workers.model_refusal(url, info.model)) is not None:
                raise APIError(409, refusal, "url")
            role = info.role
        known = workers.find(url) is not None
        try:
            worker = workers.add(url, role)
        except ValueError as error:
            raise APIError(409, str(error), "url") from None
        await workers.probe(worker)
        if worker.refused is not None and not known:  # another model: nothing added
            workers.remove(url)
            raise APIError(409, worker.refused, "url")
        return JSONResponse(describe_worker(worker))

    @router.delete("/workers")
    async def remove_worker(url: str) -> Response:
        check_enabled()
        worker = workers.remove(checked_url(url))
        if worker is None:
            raise APIError(404, f"no worker {url}", "url")
        return JSONResponse(describe_worker(worker))

    return router
