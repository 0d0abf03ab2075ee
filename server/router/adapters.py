"""vLLM's run-time LoRA routes behind the router: `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` go to every worker, prefill and decode alike (both halves compute
under the adapter). The answer is the first refusal (a load that some workers took is undone on
them, so the pair never serves an adapter on one side only), else the workers' success."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import APIRouter, Request
from fastapi.responses import Response

from baton.server.router.answers import NO_CODING, SMALL_BODY_BYTES, BadAnswer, exchange
from baton.server.router.failures import error_response, worker_error_body
from baton.server.router.relay import forward_headers
from baton.server.router.workers import WorkerSet, describe

TIMEOUT_S = 300.0  # reading an adapter from disk on every worker
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def adapter_routes(workers: WorkerSet, client: httpx.AsyncClient) -> APIRouter:
    router = APIRouter()

    async def everywhere(request: Request, path: str, body: dict) -> list:
        targets = workers.usable("prefill") + workers.usable("decode")

        async def one(worker):
            forwarded = client.build_request(
                "POST", f"{worker.url}{path}", headers={**forward_headers(request), **NO_CODING},
                json=body,
            )  # fmt: skip
            try:
                return worker, await asyncio.wait_for(
                    exchange(client, forwarded, SMALL_BODY_BYTES, f"{worker.url}'s answer"),
                    TIMEOUT_S,
                )
            except (httpx.HTTPError, BadAnswer, TimeoutError) as error:
                return worker, error

        return await asyncio.gather(*map(one, targets))

    async def call(request: Request, path: str) -> Response:
        body = getattr(request.state, "json_body", None)
        if not isinstance(body, dict):
            return error_response(400, "the body must be a JSON object")
        if not workers.ready:
            return error_response(503, "no healthy prefill and decode worker")
        answers = await everywhere(request, path, body)
        failed = [(w, a) for w, a in answers if isinstance(a, Exception) or a.status != 200]
        if not failed:
            return Response(answers[0][1].body, media_type="text/plain")
        done = [w for w, a in answers if not isinstance(a, Exception) and a.status == 200]
        if path == LOAD and done:  # undo where it was loaded
            undo = {"lora_name": body.get("lora_name")}
            for worker in done:
                forwarded = client.build_request(
                    "POST", f"{worker.url}{UNLOAD}",
                    headers={**forward_headers(request), **NO_CODING}, json=undo,
                )  # fmt: skip
                try:
                    await exchange(client, forwarded, SMALL_BODY_BYTES, "an unload's answer")
                except (httpx.HTTPError, BadAnswer):
                    pass  # that worker's own failure shows on its health probes
        worker, answer = failed[0]
        if isinstance(answer, Exception):
            return error_response(503, f"worker {worker.url} unreachable: {describe(answer)}")
        text = worker_error_body(answer.status, answer.body.decode(errors="replace"))
        return error_response(
            answer.status if 400 <= answer.status < 500 else 502,
            f"worker {worker.url}: {text['error']['message']}",
        )

    @router.post(LOAD)
    async def load_lora_adapter(request: Request) -> Response:
        return await call(request, LOAD)

    @router.post(UNLOAD)
    async def unload_lora_adapter(request: Request) -> Response:
        return await call(request, UNLOAD)

    return router
