"""How the router relays one try of a request: the decode worker's answer held back until it
carries output (so a failure before that can be retried elsewhere), then passed through; the
prefill half watched meanwhile; both halves aborted when the client leaves.

    send both halves ──> decode headers ──> (stream) lines held back ──> first output line
           │                  │                     │                        │ committed: the
           └──── prefill fails, decode fails, an error event, the client leaves: a Failure
                 (retryable when it is the worker's fault: refused, reset, 503) or an answer

Closing a worker connection is how an abort reaches it: each worker aborts a request whose
client disconnected. A non-streaming decode answer has no headers until it is complete, so the
client is watched from the moment the request is sent. A chat stream opens with one role chunk
per choice before any token: those are held back too, since the handover may still fail.

A worker's answer is read within bounds and checked (router/answers.py): one that is cut short,
not JSON, or too large is a 502 to the client, counted against that worker's circuit like any
failure of its own. And each try has a first-byte deadline (`FirstByte`,
--worker-first-byte-timeout-secs): the worker that owes the request's first token must deliver
it in time, or the try fails with a 504 naming it (and is tried elsewhere):

    streamed request:      the decode worker's headers (sent at once by a live worker), then
                           its first output line (the prefill half's first token, handed over)
    non-streamed request:  the prefill half's answer (sent once it sampled the first token);
                           the decode worker's answer starts only when it is complete, so once
                           the prefill half answered, it is bounded by max_tokens, not by this
    scoring (echo + logprobs, served whole by a prefill worker): its answer
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response

from baton.server.router.answers import Answer, BadAnswer, sse_lines
from baton.server.router.failures import (
    GONE,
    Failure,
    FirstByte,
    error_body,
    error_response,
    worker_error_body,
)
from baton.server.router.workers import Worker, WorkerSet, describe

logger = logging.getLogger("baton.router")


def forward_headers(request: Request) -> dict[str, str]:
    keep = ("authorization", "content-type")
    return {k: v for k, v in request.headers.items() if k.lower() in keep}


def prefill_failure(task: asyncio.Future, prefill: Worker, workers: WorkerSet) -> Failure | None:
    """None while the prefill side is fine or still running; a Failure once it failed: the
    worker's own refusal (the message marked as the prefill worker's), a 503 when it could not
    be reached, a 502 when its answer was broken."""
    if not task.done() or task.cancelled():
        return None
    error = task.exception()
    if isinstance(error, httpx.HTTPError):
        return Failure.unreachable(prefill, error, workers)
    if isinstance(error, BadAnswer):
        return Failure.malformed(prefill, error)
    if error is not None:
        raise error
    answer: Answer = task.result()
    if answer.status == 200:
        return None
    body = worker_error_body(answer.status, answer.body.decode(errors="replace"))
    body["error"]["message"] = f"prefill worker: {body['error']['message']}"
    return Failure.answered(prefill, answer.status, body)


def prefill_answered(task: asyncio.Future) -> bool:
    """The prefill half answered 200: the request's first token exists."""
    return (
        task.done()
        and not task.cancelled()
        and task.exception() is None
        and task.result().status == 200
    )


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def client_gone() -> Response:
    return error_response(499, "client closed the request")  # nobody reads it


async def decode_headers(
    request: Request,
    sending: asyncio.Future,
    prefill_task: asyncio.Future,
    pair: tuple[Worker, Worker],
    workers: WorkerSet,
    first_byte: FirstByte,
    stream: bool,
) -> Failure | Response | None:
    """Wait for the decode worker's answer to start; None once it has. A non-streaming answer
    starts only when it is complete, so the prefill half is watched meanwhile: when it fails
    (it refused the request, or its worker went away), the client gets the prefill's error now,
    not when the decode side gives up waiting for state that will never come (its transfer
    timeout, minutes). A client that leaves gets a 499 that nobody reads. `first_byte` holds
    until the headers of a stream, or until the prefill half answered (module docstring)."""
    prefill, decode = pair
    hangup = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        while not sending.done():
            watched = {sending, hangup} | (set() if prefill_task.done() else {prefill_task})
            bounded = stream or not prefill_answered(prefill_task)
            done, _ = await asyncio.wait(
                watched,
                timeout=first_byte.left() if bounded else None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not done:
                return Failure.late(decode if stream else prefill, first_byte.seconds)
            if sending.done():
                break
            if hangup.done():
                return client_gone()
            failure = prefill_failure(prefill_task, prefill, workers)
            if failure is not None:
                return failure
    finally:
        hangup.cancel()
    return None


@dataclass(frozen=True, kw_only=True)
class Committed:
    """A stream that carries output: what was held back, and the rest of its lines (None when
    it already ended)."""

    held: list[str]
    rest: AsyncIterator[str] | None


def _event(line: str) -> str:
    """What a held-back SSE line is: "error" (an error event), "opener" (a chat choice's role
    chunk, sent before any token), "output" (a token, the end), or "broken" (data that is
    neither a JSON object nor [DONE], or a chat chunk whose choices are not objects)."""
    if not line.startswith("data:"):
        return "opener"  # a comment or a field line: carries nothing
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return "output"
    try:
        payload = json.loads(data)
    except (ValueError, RecursionError):
        return "broken"
    if not isinstance(payload, dict):
        return "broken"
    if "error" in payload:
        return "error"
    choices = payload.get("choices")
    if payload.get("object") == "chat.completion.chunk" and choices:
        if not isinstance(choices, list) or not all(
            isinstance(choice, dict) and isinstance(choice.get("delta", {}), dict)
            for choice in choices
        ):
            return "broken"
        if all(
            set(choice.get("delta", {})) <= {"role", "content"}
            and not choice.get("delta", {}).get("content")
            and choice.get("finish_reason") is None
            for choice in choices
        ):
            return "opener"
    return "output"


async def first_output(
    request: Request,
    upstream: httpx.Response,
    prefill_task: asyncio.Future,
    pair: tuple[Worker, Worker],
    workers: WorkerSet,
    first_byte: FirstByte,
) -> Committed | Failure | Response:
    """Hold the decode worker's stream back until a line carries output (or it ends), within
    `first_byte`: past it, the prefill worker is late if its half has not answered, else the
    decode worker."""
    prefill, decode = pair
    lines = sse_lines(upstream, f"decode worker {decode.url}'s stream")
    held: list[str] = []
    pending: asyncio.Future | None = None
    hangup = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(lines.__anext__())
            watched = {pending, hangup} | (set() if prefill_task.done() else {prefill_task})
            done, _ = await asyncio.wait(
                watched, timeout=first_byte.left(), return_when=asyncio.FIRST_COMPLETED
            )
            if not done:
                late = prefill if not prefill_task.done() else decode
                return Failure.late(late, first_byte.seconds)
            if hangup.done():
                return client_gone()
            failure = prefill_failure(prefill_task, prefill, workers)
            if failure is not None:
                return failure
            if not pending.done():
                continue
            try:
                line = pending.result()
            except StopAsyncIteration:
                return Committed(held=held, rest=None)
            except httpx.HTTPError as error:
                return Failure.unreachable(decode, error, workers)
            except BadAnswer as error:
                return Failure.malformed(decode, error)
            pending = None
            if not line:
                continue
            kind = _event(line)
            if kind == "broken":
                return Failure.malformed(decode, BadAnswer(f"a stream event {line[:120]!r}"))
            if kind == "error":
                body = worker_error_body(503, line[len("data:") :])
                code = body["error"]["code"]
                return Failure.answered(decode, code if isinstance(code, int) else 503, body)
            held.append(line)
            if kind == "output":
                return Committed(held=held, rest=lines)
    finally:
        hangup.cancel()
        if pending is not None and not pending.done():
            pending.cancel()


async def relay(
    committed: Committed,
    upstream: httpx.Response,
    decode: Worker,
    workers: WorkerSet,
    finish: Callable[[], None],
) -> AsyncIterator[str]:
    """Pass the committed stream through; a decode worker that fails mid-stream ends it with an
    error event followed by `data: [DONE]` (as vLLM and the workers end a failed stream). The
    prefill half is not watched any more: its state reached the decode worker, which notices a
    prefill worker that dies before the rest of a multi-choice request's state arrives."""
    try:
        for line in committed.held:
            yield line + "\n\n"
        if committed.rest is not None:
            async for line in committed.rest:
                if line:
                    yield line + "\n\n"
    except (httpx.HTTPError, BadAnswer) as error:
        if isinstance(error, GONE):
            workers.lost(decode, error)
        if isinstance(error, BadAnswer):
            workers.failed(decode, str(error))
        status = 502 if isinstance(error, BadAnswer) else 503
        message = f"{decode.role} worker {decode.url} failed mid-stream: {describe(error)}"
        yield f"data: {json.dumps(error_body(status, message))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        finish()
        await upstream.aclose()


async def cancel(work: asyncio.Future) -> None:
    """Cancel an HTTP exchange and wait until its connection is closed (the worker on the other
    end then aborts the request)."""
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await work
