"""The disaggregation router: one prefill and one decode worker per request.

    client ──> router ──(same body + room, stream off)──> prefill worker ──state over ZMQ──┐
                  └────(same body + room + transfer address)──> decode worker <───────────┘
                  <──────────────── the decode worker's answer, streamed ─────┘

The router mints the room id itself (a client's `baton_disagg` field is dropped), picks each
side's worker by that side's policy (`router/policies/`: round robin, random, power of two,
cache-aware over Mamba checkpoints), learns each worker's role, transfer address and cache
geometry from its `/disagg/info`, and probes every worker's health once a second on connections
of its own (`router/workers.py`); its workers serve one model, whose tokenizer cache_aware learns
from them (`router/model.py`). Nothing a worker sends is read unbounded or passed on unchecked
(`router/answers.py`). Workers come and go while it serves (`router/admin.py`,
`router/discovery.py`). It checks every request with the workers' own rules before it sends
anything (`validation.py`). At most `--max-concurrent-requests` requests are in flight; past
that the router answers 429 with Retry-After rather than queueing where nobody can see it.
One request is `router/dispatch.py`: tries on pairs until one commits, a try that failed before
any byte reached the client tried again elsewhere; relaying one try is `router/relay.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from baton.server.args import DEFAULT_MAX_REQUEST_BYTES
from baton.server.errors import APIError, ErrorJSONResponse, install_error_handlers
from baton.server.middleware import OPEN_PATHS, AnswerGuard, ApiKeyMiddleware, RequestBodyMiddleware
from baton.server.openai.validation import parse_generation
from baton.server.router.adapters import adapter_routes
from baton.server.router.admin import admin_routes
from baton.server.router.answers import ANSWER_BODY_BYTES, NO_CODING, BadAnswer, exchange
from baton.server.router.args import RoutingArgs
from baton.server.router.cli import DEFAULT_MAX_CONCURRENT_REQUESTS
from baton.server.router.discovery import start_discovery
from baton.server.router.dispatch import NO_PAIR, Dispatcher, once
from baton.server.router.failures import Failure, error_response, passable, worker_error_body
from baton.server.router.policies import make_policy
from baton.server.router.prompt import routing_tokens
from baton.server.router.relay import forward_headers
from baton.server.router.urls import worker_url
from baton.server.router.workers import PROBE_TIMEOUT_S, RETRY_AFTER_S, WorkerSet, describe
from baton.server.tokenizer import load_tokenizer
from baton.server.version import baton_version

ROUTER_KEEPALIVE_EXPIRY_S = 10.0  # idle connections to workers; below SERVER_KEEP_ALIVE_S
DEFAULT_ROUTING = RoutingArgs()


def build_router_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    api_key: str | None = None,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    *,
    routing: RoutingArgs = DEFAULT_ROUTING,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The router's app. `transport` replaces the network under both of its HTTP clients (tests
    pass an in-process fake of the workers). ValueError names a worker URL that is not one, or
    RuntimeError a --tokenizer that does not load."""
    rng = random.Random()
    policies = {
        "prefill": make_policy(routing.prefill_policy, routing.cache_aware, rng),
        "decode": make_policy(routing.decode_policy, routing.cache_aware, rng),
    }
    needs_tokens = any(policy.needs_tokens for policy in policies.values())
    workers = WorkerSet(
        max_concurrent_requests=max_concurrent_requests,
        # Probes have connections of their own, apart from request traffic; they carry the
        # router's key, which the workers' /disagg/info requires (their /health is open).
        probe_client=httpx.AsyncClient(
            timeout=PROBE_TIMEOUT_S,
            transport=transport,
            headers={**NO_CODING, **({"Authorization": f"Bearer {api_key}"} if api_key else {})},
        ),
        policies=policies,
        circuit=routing.circuit,
        # --tokenizer overrides what the router learns from its workers (router/model.py)
        tokenizer_override=(
            load_tokenizer(routing.tokenizer, "--tokenizer")
            if needs_tokens and routing.tokenizer is not None
            else None
        ),
    )
    for flag, urls, role in (
        ("--prefill", prefill_urls, "prefill"),
        ("--decode", decode_urls, "decode"),
    ):
        for url in urls:
            try:
                workers.add(worker_url(url), role)
            except ValueError as error:
                raise ValueError(f"{flag}: {error}") from None
    # Request traffic has no hidden connection cap: each request in flight holds two connections
    # (the prefill POST and the decode stream) and the explicit limit is the admission check.
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(None, connect=5.0),
        limits=httpx.Limits(
            max_connections=None,
            max_keepalive_connections=256,
            keepalive_expiry=ROUTER_KEEPALIVE_EXPIRY_S,  # well before the workers drop them
        ),
        transport=transport,
        headers=NO_CODING,
    )
    dispatcher = Dispatcher(
        workers=workers,
        client=client,
        retry=routing.retry,
        rng=rng,
        first_byte_timeout_s=routing.first_byte_timeout_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await workers.probe_all()
        task = asyncio.create_task(workers.probe_forever())
        discovery = (
            start_discovery(workers, routing.discovery, asyncio.get_running_loop())
            if routing.discovery is not None
            else []
        )
        yield
        for pod_watch in discovery:
            pod_watch.stop()
        task.cancel()
        await workers.tokenizer.close()
        await client.aclose()
        await workers.probe_client.aclose()

    app = FastAPI(title="baton router", lifespan=lifespan)
    app.state.workers = workers
    install_error_handlers(app)  # unknown routes and wrong methods in OpenAI's error shape
    # The workers' own body checks (413, strict JSON) and key rule (all but /health, /metrics).
    app.add_middleware(RequestBodyMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)
    app.include_router(admin_routes(workers, api_key))
    app.include_router(adapter_routes(workers, client))
    # outermost: every answer counted (413s, 401s and 404s too), none a plain-text 500
    app.add_middleware(
        AnswerGuard,
        count=lambda status: workers.metrics.requests.labels(status=str(status)).inc(),
        uncounted=OPEN_PATHS,
    )

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) liveness route
    async def health() -> Response:
        if not workers.ready:
            return error_response(503, NO_PAIR)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(workers.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> dict:
        return {"version": baton_version()}

    @app.get("/v1/models")
    @app.get("/v1/models/{model:path}")
    @app.post("/tokenize")
    @app.post("/detokenize")
    async def ask_a_decode_worker(request: Request) -> Response:
        """The decode worker's answer to a request about the model (the list or one model, as
        OpenAI's retrieve; /tokenize and /detokenize): nothing is generated, no pair is used.
        The whole answer is its first byte, so it has the first-byte deadline."""
        decode = workers.least_loaded_decode()
        if decode is None or not workers.ready:
            return error_response(503, NO_PAIR)
        path = request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
        body = getattr(request.state, "json_body", None)  # parsed by RequestBodyMiddleware
        forwarded = client.build_request(
            request.method,
            f"{decode.url}{path}",
            headers={**forward_headers(request), **NO_CODING},
            json=body if request.method == "POST" else None,
        )
        what = f"decode worker {decode.url}'s answer"
        try:
            answer = await asyncio.wait_for(
                exchange(client, forwarded, ANSWER_BODY_BYTES, what), routing.first_byte_timeout_s
            )
        except TimeoutError:
            return Failure.late(decode, routing.first_byte_timeout_s, "answer").response
        except httpx.HTTPError as error:
            return error_response(503, f"decode worker {decode.url} unreachable: {describe(error)}")
        except BadAnswer as error:
            return error_response(502, f"decode worker {decode.url}: {error}")
        if not passable(answer.status):
            text = worker_error_body(answer.status, answer.body.decode(errors="replace"))
            message = text["error"]["message"]
            return error_response(
                502, f"decode worker {decode.url} answered {answer.status}: {message}"[:2000]
            )
        return Response(answer.body, status_code=answer.status, media_type="application/json")

    async def generate(request: Request, path: str) -> Response:
        if not workers.try_admit():
            message = (
                f"the router has {workers.max_concurrent_requests} requests in flight "
                "(--max-concurrent-requests); retry later"
            )
            return JSONResponse(  # as OpenAI answers a rate limit
                {
                    "error": {
                        "message": message,
                        "type": "requests",
                        "param": None,
                        "code": "rate_limit_exceeded",
                    }
                },
                status_code=429,
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        release = once(workers.release)
        try:
            response = await dispatch(request, path, release)
        except BaseException:
            release()
            raise
        if not isinstance(response, StreamingResponse):
            release()
        return response

    async def dispatch(request: Request, path: str, release) -> Response:
        # The workers' own rules, before anything is dispatched: a request either half would
        # refuse never starts a prefill (the prefill half never sees `stream_options`).
        body = getattr(request.state, "json_body", None)  # parsed by RequestBodyMiddleware
        tokenizer = workers.tokenizer.current
        try:
            parsed = parse_generation(path, body)
            prompt = (
                await asyncio.to_thread(routing_tokens, tokenizer, parsed)
                if tokenizer is not None
                else None
            )
        except APIError as error:
            return ErrorJSONResponse(error.body(), status_code=error.status)
        assert isinstance(body, dict)
        return await dispatcher.serve(request, path, body, prompt, release)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "/v1/chat/completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await generate(request, "/v1/responses")

    @app.post("/generate")
    async def sglang_generate(request: Request) -> Response:
        return await generate(request, "/generate")

    return app
