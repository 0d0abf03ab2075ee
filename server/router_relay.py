"""How the router relays one request: the decode worker's answer passed through (streamed or
collected), the prefill half watched alongside, and both halves aborted when the client leaves.

Closing a worker connection is how an abort reaches it: each worker aborts a request whose
client disconnected. A non-streaming decode answer has no headers until it is complete, so the
client is watched from the moment the request is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from server.errors import ErrorJSONResponse
from server.router_workers import Worker, WorkerSet, describe

logger = logging.getLogger("baton.router")


def error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = (
        "invalid_request_error"
        if status < 500
        else "service_unavailable"
        if status == 503
        else "internal_error"
    )
    return {
        "error": {
            "message": message,
            "type": kind,
            "param": None,
            "code": code or status,
        }
    }


def error_response(status: int, message: str) -> JSONResponse:
    return ErrorJSONResponse(error_body(status, message), status_code=status)


# Transport errors that prove a worker is gone (refused, or its connection dropped), as opposed to
# a slow answer; they take the worker out at once, and the next passing probe puts it back.
GONE = (
    httpx.ConnectError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.RemoteProtocolError,
)


def forward_headers(request: Request) -> dict[str, str]:
    keep = ("authorization", "content-type")
    return {k: v for k, v in request.headers.items() if k.lower() in keep}


async def prefill_error(
    task: asyncio.Task, prefill: Worker, workers: WorkerSet
) -> tuple[int, dict] | None:
    """None while the prefill side is fine or still running; (status, error body) once it
    failed: the worker's own refusal (its param, type and code kept, the message marked as the
    prefill worker's), or a 503 when it could not be reached."""
    if not task.done():
        return None
    try:
        response = task.result()
    except asyncio.CancelledError:
        return None
    except httpx.HTTPError as error:
        logger.warning("prefill worker %s failed: %s", prefill.url, describe(error))
        if isinstance(error, GONE):
            workers.lost(prefill, error)
        return 503, error_body(503, f"prefill worker {prefill.url} failed: {describe(error)}")
    if response.status_code != 200:
        body = error_body(response.status_code, response.text)
        try:
            given = response.json()["error"]
            body["error"].update(
                {key: given[key] for key in ("message", "type", "param", "code") if key in given}
            )
        except (ValueError, KeyError, TypeError):
            pass  # not the OpenAI error shape: its text is the message
        message = str(body["error"]["message"])
        logger.warning(
            "prefill worker %s answered %d: %s", prefill.url, response.status_code, message[:500]
        )
        body["error"]["message"] = f"prefill worker: {message}"
        return response.status_code, body
    return None


async def relay(
    upstream: httpx.Response,
    prefill_task: asyncio.Task,
    prefill: Worker,
    decode: Worker,
    workers: WorkerSet,
    release,
):
    """Pass the decode worker's SSE stream through; if either side fails, end with an error
    event followed by `data: [DONE]` (as vLLM and the workers end a failed stream)."""
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
            failure = await prefill_error(prefill_task, prefill, workers)
            if failure is not None:
                yield f"data: {json.dumps(failure[1])}\n\n"
                yield "data: [DONE]\n\n"
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
        if isinstance(error, GONE):
            workers.lost(decode, error)
        message = f"{decode.role} worker {decode.url} failed mid-stream: {describe(error)}"
        yield f"data: {json.dumps(error_body(503, message))}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        release()
        if pending_line is not None and not pending_line.done():
            pending_line.cancel()
        if not prefill_task.done():
            prefill_task.cancel()
        await upstream.aclose()


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def decode_headers(
    request: Request,
    sending: asyncio.Future,
    prefill_task: asyncio.Task,
    prefill: Worker,
    workers: WorkerSet,
) -> Response | None:
    """Wait for the decode worker's answer to start; None once it has. A non-streaming answer
    starts only when it is complete, so the prefill half is watched meanwhile: when it fails
    (it refused the request, or its worker went away), the decode half is cancelled and the
    client gets the prefill's error now, not when the decode side gives up waiting for state
    that will never come (its transfer timeout, minutes). A client that leaves cancels both."""
    hangup = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        while not sending.done():
            watched = {sending, hangup} | (set() if prefill_task.done() else {prefill_task})
            await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
            if sending.done():
                break
            if hangup.done():
                prefill_task.cancel()
                await _cancel(sending)
                return error_response(499, "client closed the request")  # nobody reads it
            failure = await prefill_error(prefill_task, prefill, workers)
            if failure is not None:
                await _cancel(sending)
                return ErrorJSONResponse(failure[1], status_code=failure[0])
    finally:
        hangup.cancel()
    return None


async def _cancel(work: asyncio.Future) -> None:
    """Cancel an HTTP exchange and wait until its connection is closed (the worker on the other
    end then aborts the request)."""
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        await work


async def collect(
    request: Request,
    upstream: httpx.Response,
    prefill_task: asyncio.Task,
    prefill: Worker,
    decode: Worker,
    workers: WorkerSet,
) -> Response:
    """Read the decode worker's whole answer; a client that hangs up meanwhile aborts both
    halves (closing each connection makes its worker abort the request)."""
    read = asyncio.ensure_future(upstream.aread())
    hangup = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        while not read.done():
            await asyncio.wait(
                {read, hangup, prefill_task} - ({prefill_task} if prefill_task.done() else set()),
                return_when=asyncio.FIRST_COMPLETED,
            )
            if hangup.done():
                read.cancel()
                prefill_task.cancel()
                return error_response(499, "client closed the request")  # nobody reads it
            failure = await prefill_error(prefill_task, prefill, workers)
            if failure is not None:
                read.cancel()
                return ErrorJSONResponse(failure[1], status_code=failure[0])
        content = read.result()
    except httpx.HTTPError as error:
        if isinstance(error, GONE):
            workers.lost(decode, error)
        return error_response(503, f"{decode.role} worker {decode.url} failed: {describe(error)}")
    finally:
        hangup.cancel()
        await upstream.aclose()
    return Response(content, status_code=upstream.status_code, media_type="application/json")
