"""Fake prefill and decode workers behind one httpx transport, for in-process router tests:
each worker (by origin) answers /health, /disagg/info and /disagg/tokenizer (the shipped
model's tokenizer, unless told otherwise), and generation requests as its `behaviour` says, and
every generation request is recorded."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from baton.server.tokenizer_bundle import TokenizerBundle, model_identity

TRACK_INTERVAL = 64
ASSETS = Path(__file__).parents[1] / "assets"
BUNDLE = TokenizerBundle.from_directory(str(ASSETS), None)
MODEL = model_identity("tiny", str(ASSETS), BUNDLE)  # what every fake serves unless told


@dataclass
class FakeWorker:
    role: str
    # "ok"; "refused" (connection refused); "503" / "400" / "500" (an error answer); "hangs"
    # (accepts the request and never answers); prefill only:
    # "dies" (its process dies mid-handover: the decode side reports the failed transfer, then
    # the prefill's connection drops); decode only:
    # "error_event" (a chat opener, then a 503 error event: a failed handover), "drop_after_token"
    # (one token, then the connection drops), "truncated" (a 200 whose JSON, or first stream
    # event, is cut short)
    behaviour: str = "ok"
    healthy: bool = True
    tokens: int = 3  # a decode worker's answer: this many tokens " t0", " t1", ...
    hold: asyncio.Event | None = None  # set: streams wait for it after their first token
    requests: list[dict] = field(default_factory=list)  # generation bodies received
    streaming: int = 0  # streams running now
    model: dict = field(default_factory=lambda: dict(MODEL))  # its /disagg/info's model
    bundle: TokenizerBundle = BUNDLE  # what its /disagg/tokenizer sends
    bundle_gate: asyncio.Event | None = None  # set: /disagg/tokenizer waits for it
    answer_delay_s: float = 0.0  # a decode worker's non-streamed answer: after its state came
    abandoned: int = 0  # requests whose connection the router closed before an answer


def _error(status: int, message: str) -> httpx.Response:
    kind = "service_unavailable" if status == 503 else "invalid_request_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return httpx.Response(status, json=body)


class Fleet(httpx.AsyncBaseTransport):
    def __init__(self, **workers: FakeWorker) -> None:
        # keyword: a host name, e.g. p1=FakeWorker("prefill") is http://p1.test
        self.workers = {f"http://{name}.test": worker for name, worker in workers.items()}
        # room -> set once its prefill succeeded: a decode worker answers only then, as a
        # real one waits for the handed-over state
        self.rooms: dict[str, asyncio.Event] = {}
        self.failed_rooms: set[str] = set()

    def room(self, body: dict) -> asyncio.Event:
        disagg = body.get("baton_disagg") or {}
        return self.rooms.setdefault(str(disagg.get("room")), asyncio.Event())

    @staticmethod
    def url(name: str) -> str:
        return f"http://{name}.test"

    def urls(self, role: str) -> list[str]:
        return [url for url, worker in self.workers.items() if worker.role == role]

    def add(self, name: str, worker: FakeWorker) -> str:
        self.workers[self.url(name)] = worker
        return self.url(name)

    def served(self, name: str) -> int:
        return len(self.workers[self.url(name)].requests)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}"
        worker = self.workers.get(origin)
        if worker is None or not worker.healthy:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/health":
            return httpx.Response(200, json={"status": "ok"})
        if path == "/disagg/info":
            info = {"role": worker.role, "page_size": 16, "track_interval": TRACK_INTERVAL}
            info["transfer_addr"] = (
                f"tcp://{request.url.host}:9" if worker.role == "prefill" else None
            )
            return httpx.Response(200, json={**info, "model": worker.model})
        if path == "/disagg/tokenizer":
            if worker.bundle_gate is not None:
                await worker.bundle_gate.wait()
            return httpx.Response(200, json=worker.bundle.to_json())
        body = json.loads(request.content)
        worker.requests.append(body)
        if worker.behaviour == "refused":
            raise httpx.ConnectError("connection refused", request=request)
        if worker.behaviour in ("503", "400", "500"):
            return _error(int(worker.behaviour), f"{worker.role} worker says {worker.behaviour}")
        if worker.behaviour == "hangs":
            try:
                await asyncio.Event().wait()
            finally:  # cancelled: the router closed the connection
                worker.abandoned += 1
        if worker.role == "prefill":
            if worker.behaviour == "dies":
                self.failed_rooms.add(str(body["baton_disagg"]["room"]))
                self.room(body).set()
                await asyncio.sleep(0.05)
                raise httpx.RemoteProtocolError("server disconnected", request=request)
            self.room(body).set()
            return httpx.Response(200, json={"choices": [{"text": "", "index": 0}]})
        chat = path == "/v1/chat/completions"
        if not body.get("stream"):
            await self.room(body).wait()
            await asyncio.sleep(worker.answer_delay_s)
            if worker.behaviour == "truncated":
                return httpx.Response(200, content=b'{"choices": [{"text": ')
            text = "".join(f" t{i}" for i in range(worker.tokens))
            choice = {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
            return httpx.Response(200, json={"choices": [{"index": 0, **choice}]})
        return httpx.Response(
            200,
            headers={"content-type": "text/event-stream"},
            content=self._stream(worker, chat, request, body),
        )

    async def _stream(
        self, worker: FakeWorker, chat: bool, request: httpx.Request, body: dict
    ) -> AsyncIterator[bytes]:
        def event(payload: dict | str) -> bytes:
            return f"data: {json.dumps(payload) if isinstance(payload, dict) else payload}\n\n".encode()

        def token(text: str) -> dict:
            if chat:
                delta = {"index": 0, "delta": {"content": text}, "finish_reason": None}
                return {"object": "chat.completion.chunk", "choices": [delta]}
            return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}

        worker.streaming += 1
        try:
            if chat:
                opener = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "finish_reason": None,
                }
                yield event({"object": "chat.completion.chunk", "choices": [opener]})
            failed = {"error": {"message": "transfer failed", "type": "service_unavailable",
                                "param": None, "code": 503}}  # fmt: skip
            if worker.behaviour == "error_event":
                yield event(failed)
                yield event("[DONE]")
                return
            await self.room(body).wait()
            if worker.behaviour == "truncated":
                yield b'data: {"choices": [{"text": \n\n'
                return
            if str(body["baton_disagg"]["room"]) in self.failed_rooms:
                yield event(failed)
                yield event("[DONE]")
                return
            for i in range(worker.tokens):
                yield event(token(f" t{i}"))
                if worker.behaviour == "drop_after_token":
                    raise httpx.ReadError("connection reset", request=request)
                if worker.hold is not None:
                    await worker.hold.wait()
            yield event("[DONE]")
        finally:
            worker.streaming -= 1


def sse_events(text: str) -> list[str]:
    """The data of each event of an SSE body."""
    return [line[len("data: ") :] for line in text.splitlines() if line.startswith("data: ")]
