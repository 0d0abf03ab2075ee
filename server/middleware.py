"""Plain ASGI middleware (not BaseHTTPMiddleware, which would hide client disconnects)."""

from __future__ import annotations

import secrets

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response


class ApiKeyMiddleware:
    """With --api-key, every /v1/* request must carry `Authorization: Bearer KEY` (else 401)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                message = "missing API key" if not given else "invalid API key"
                response = error_response(401, f"{message}: send `Authorization: Bearer <key>`")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
