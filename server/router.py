"""The disaggregation router: one prefill and one decode worker per request.

    client ──> router ──(same body + room, stream off)──> prefill worker ──state over ZMQ──┐
                  └────(same body + room + transfer address)──> decode worker <───────────┘
                  <──────────────── the decode worker's answer, streamed ─────┘

The router mints the room id itself (a client's `baton_disagg` field is dropped), picks workers
round-robin among the healthy ones, learns each prefill worker's transfer address from its
`/disagg/info`, and health-checks every worker once a second. If the prefill side fails, the
decode request is cancelled (the decode worker aborts it on disconnect) and the client gets the
error; a broken decode stream ends with an error event, never with `[DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import uuid
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("baton.router")

HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 2.0


def error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = (
        "invalid_request_error"
        if status < 500
        else "service_unavailable"
        if status == 503
        else "internal_error"
    )
    return {"error": {"message": message, "type": kind, "param": None, "code": code or status}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


@dataclass
class Worker:
    url: str
    role: str
    healthy: bool = False
    transfer_addr: str | None = None  # prefill workers only


@dataclass
class RouterState:
    prefill: list[Worker]
    decode: list[Worker]
    client: httpx.AsyncClient
    api_key: str | None = None
    _turn: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> tuple[Worker, Worker] | None:
        prefill = [w for w in self.prefill if w.healthy and w.transfer_addr]
        decode = [w for w in self.decode if w.healthy]
        if not prefill or not decode:
            return None
        turn = next(self._turn)
        return prefill[turn % len(prefill)], decode[turn % len(decode)]

    @property
    def ready(self) -> bool:
        return self.pick() is not None

    async def check(self, worker: Worker) -> None:
        try:
            response = await self.client.get(f"{worker.url}/health", timeout=HEALTH_TIMEOUT_S)
            healthy = response.status_code == 200
            if healthy and worker.role == "prefill" and worker.transfer_addr is None:
                info = await self.client.get(f"{worker.url}/disagg/info", timeout=HEALTH_TIMEOUT_S)
                worker.transfer_addr = info.json()["transfer_addr"]
        except (httpx.HTTPError, KeyError, ValueError):
            healthy = False
        if not healthy:
            worker.transfer_addr = None  # a restarted prefill worker may listen elsewhere
        if healthy != worker.healthy:
            logger.info(
                "%s worker %s is %s", worker.role, worker.url, "healthy" if healthy else "unhealthy"
            )
        worker.healthy = healthy

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.prefill + self.decode))


def build_router_app(
    prefill_urls: list[str], decode_urls: list[str], api_key: str | None = None
) -> FastAPI:
    state = RouterState(
        prefill=[Worker(url=u.rstrip("/"), role="prefill") for u in prefill_urls],
        decode=[Worker(url=u.rstrip("/"), role="decode") for u in decode_urls],
        client=httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)),
        api_key=api_key,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def health_loop():
            while True:
                await state.check_all()
                await asyncio.sleep(HEALTH_INTERVAL_S)

        await state.check_all()
        task = asyncio.create_task(health_loop())
        yield
        task.cancel()
        await state.client.aclose()

    app = FastAPI(title="baton router", lifespan=lifespan)
    app.state.router = state

    def authorized(request: Request) -> bool:
        return (
            state.api_key is None
            or request.headers.get("authorization") == f"Bearer {state.api_key}"
        )

    @app.get("/health")
    async def health() -> Response:
        if not state.ready:
            return error_response(503, "no healthy prefill + decode worker pair")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not authorized(request):
            return error_response(401, "invalid or missing API key")
        pair = state.pick()
        if pair is None:
            return error_response(503, "no healthy prefill + decode worker pair")
        response = await state.client.get(
            f"{pair[1].url}/v1/models", headers=_forward_headers(request)
        )
        return Response(
            response.content, status_code=response.status_code, media_type="application/json"
        )

    async def generate(request: Request, path: str) -> Response:
        if not authorized(request):
            return error_response(401, "invalid or missing API key")
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "request body must be a JSON object")
        pair = state.pick()
        if pair is None:
            return error_response(503, "no healthy prefill + decode worker pair")
        prefill, decode = pair
        room = uuid.uuid4().hex  # minted here; a client's value is never trusted
        headers = _forward_headers(request)
        decode_body = dict(body, baton_disagg={"room": room, "prefill_addr": prefill.transfer_addr})
        prefill_body = dict(body, stream=False, baton_disagg={"room": room})
        prefill_body.pop("stream_options", None)
        prefill_task = asyncio.create_task(
            state.client.post(f"{prefill.url}{path}", json=prefill_body, headers=headers)
        )
        try:
            upstream = await state.client.send(
                state.client.build_request(
                    "POST", f"{decode.url}{path}", json=decode_body, headers=headers
                ),
                stream=True,
            )
        except httpx.HTTPError as error:
            decode.healthy = False
            prefill_task.cancel()
            return error_response(503, f"decode worker {decode.url} unreachable: {error}")
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            prefill_task.cancel()
            return Response(
                content, status_code=upstream.status_code, media_type="application/json"
            )
        if body.get("stream"):
            return StreamingResponse(
                _relay(upstream, prefill_task, prefill, decode), media_type="text/event-stream"
            )
        return await _collect(upstream, prefill_task, prefill, decode)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    return app


def _forward_headers(request: Request) -> dict[str, str]:
    keep = ("authorization", "content-type")
    return {k: v for k, v in request.headers.items() if k.lower() in keep}


async def _prefill_error(task: asyncio.Task, prefill: Worker) -> tuple[int, str] | None:
    """None while the prefill side is fine or still running; (status, message) once it failed."""
    if not task.done():
        return None
    try:
        response = task.result()
    except asyncio.CancelledError:
        return None
    except httpx.HTTPError as error:
        prefill.healthy = False
        return 503, f"prefill worker {prefill.url} failed: {error}"
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        return response.status_code, f"prefill worker: {message}"
    return None


async def _relay(
    upstream: httpx.Response, prefill_task: asyncio.Task, prefill: Worker, decode: Worker
):
    """Pass the decode worker's SSE stream through; end with an error event if either side fails."""
    lines = upstream.aiter_lines()
    pending_line: asyncio.Task | None = None
    try:
        while True:
            if pending_line is None:
                pending_line = asyncio.ensure_future(lines.__anext__())
            done, _ = await asyncio.wait(
                {pending_line, prefill_task} - ({prefill_task} if prefill_task.done() else set()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            failure = await _prefill_error(prefill_task, prefill)
            if failure is not None:
                yield f"data: {json.dumps(error_body(*failure))}\n\n"
                return
            if pending_line in done:
                try:
                    line = pending_line.result()
                except StopAsyncIteration:
                    return
                pending_line = None
                if line:
                    yield line + "\n\n"
    except httpx.HTTPError as error:
        decode.healthy = False
        yield f"data: {json.dumps(error_body(503, f'decode worker {decode.url} failed mid-stream: {error}'))}\n\n"
    finally:
        if pending_line is not None and not pending_line.done():
            pending_line.cancel()
        if not prefill_task.done():
            prefill_task.cancel()
        await upstream.aclose()


async def _collect(
    upstream: httpx.Response, prefill_task: asyncio.Task, prefill: Worker, decode: Worker
) -> Response:
    read = asyncio.ensure_future(upstream.aread())
    try:
        while not read.done():
            await asyncio.wait(
                {read, prefill_task} - ({prefill_task} if prefill_task.done() else set()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            failure = await _prefill_error(prefill_task, prefill)
            if failure is not None:
                read.cancel()
                return error_response(*failure)
        content = read.result()
    except httpx.HTTPError as error:
        decode.healthy = False
        return error_response(503, f"decode worker {decode.url} failed: {error}")
    finally:
        await upstream.aclose()
    return Response(content, status_code=upstream.status_code, media_type="application/json")


def add_router_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "router",
        help="route requests across prefill and decode workers",
        description="Serve the OpenAI API by sending each request to one prefill and one decode worker "
        "(started with `baton serve --disaggregation-mode prefill|decode`).",
    )
    parser.add_argument("--prefill", required=True, help="prefill worker URL(s), comma-separated")
    parser.add_argument("--decode", required=True, help="decode worker URL(s), comma-separated")
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--api-key", help="require `Authorization: Bearer KEY` (forwarded to workers)"
    )
    parser.set_defaults(handler=_run_router)


def _run_router(namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check otherwise
    prefill = [u for u in namespace.prefill.split(",") if u]
    decode = [u for u in namespace.decode.split(",") if u]
    app = build_router_app(prefill, decode, namespace.api_key)
    uvicorn.run(app, host=namespace.host, port=namespace.port, log_level="warning")
    return 0
