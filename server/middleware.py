"""Plain ASGI middleware (not BaseHTTPMiddleware, which would hide client disconnects)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton.engine.runtime.cpu_allocator import release_freed_memory
from baton.server.errors import APIError, error_response
from baton.server.openai.validation import parse_json_body

logger = logging.getLogger("baton.server")

# Open with or without --api-key: probes (Kubernetes, the router) and Prometheus scrapes carry no
# key, as with vLLM. Everything else (/v1/*, /tokenize, /detokenize, /disagg/*, /docs,
# /openapi.json) costs CPU or describes the deployment, so it follows the key.
OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})
TRIM_AFTER_BYTES = 1 << 20  # bodies at least this large are followed by malloc_trim


def bearer_matches(authorization: bytes, api_key: str) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 9110 makes it case-insensitive)."""
    scheme, _, token = authorization.strip().partition(b" ")
    return scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), api_key.encode())


class ApiKeyMiddleware:
    """With --api-key, every request but OPEN_PATHS must carry `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not bearer_matches(given, self.api_key):
                message = "missing API key" if not given else "invalid API key"
                response = error_response(401, f"{message}: send `Authorization: Bearer <key>`")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestBodyMiddleware:
    """Reads a POST body before the app sees it: 413 once it passes `max_bytes` (without reading
    the rest), 400 for JSON that the shared strict parser refuses (NaN, Infinity, 1e400, nesting
    too deep). The parsed body is left in `request.state.json_body` for handlers that want it;
    after the body, `receive` is the client's own again, so disconnects are still seen."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before it finished sending: nobody to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
        if raw:
            try:
                scope.setdefault("state", {})["json_body"] = parse_json_body(raw)
            except APIError as error:
                await error_response(error.status, error.message, error.param)(scope, receive, send)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        try:
            await self.app(scope, replay, send)
        finally:
            if size >= TRIM_AFTER_BYTES:  # a large body (its copies, its tokens) is gone now:
                chunks.clear()  # give the memory back (server/openai/prompt_bound.py says why)
                raw = b""
                scope.get("state", {}).pop("json_body", None)
                await asyncio.to_thread(release_freed_memory)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413,
            f"request body is larger than --max-request-bytes ({self.max_bytes} bytes)",
        )
        await response(scope, receive, send)


class RequestCounterMiddleware:
    """Counts requests to the given paths by path and response status."""

    def __init__(self, app: ASGIApp, counter: Counter, paths: tuple[str, ...]) -> None:
        self.app = app
        self.counter = counter
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        status = 500  # if the app raises before answering, the server answers 500

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        finally:
            self.counter.labels(scope["path"], str(status)).inc()


class AnswerGuard:
    """The outermost layer: every answer is counted by status (`count`, but not for `uncounted`
    paths), and an exception nothing else handled becomes an OpenAI-shaped 500, logged with its
    traceback. Without it Starlette answers a plain-text 500 and the connection is closed, so a
    client's next keep-alive request on it fails."""

    def __init__(
        self, app: ASGIApp, count: Callable[[int], None], uncounted: frozenset[str]
    ) -> None:
        self.app = app
        self.count = count
        self.uncounted = uncounted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None

        async def send_and_note_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note_status)
        except Exception:
            logger.exception("%s %s failed", scope["method"], scope["path"])
            if status is None:  # nothing sent yet: the client gets an answer it can read
                status = 500
                answer = error_response(500, "internal error while serving this request")
                await answer(scope, receive, send)
        finally:
            if status is not None and scope["path"] not in self.uncounted:
                self.count(status)
