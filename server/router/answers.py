"""Reading a worker's answers: every byte from a worker is hostile until checked.

A worker is a process the router does not control (a pod anyone with the selector's labels can
be, a URL an operator typed). So nothing it sends is read whole before its size is known to be
sane, and nothing it sends reaches a client unchecked:

    what                         at most              when it is more, or not what it should be
    /health                      HEALTH_BODY_BYTES    a failed probe
    /disagg/info, error answers  SMALL_BODY_BYTES     the worker's info unread / a 502
    /disagg/tokenizer            TOKENIZER_BODY_BYTES the tokenizer not learned from that worker
    a non-streamed answer        ANSWER_BODY_BYTES    a 502 that counts against its circuit
    one line of a stream         SSE_LINE_BYTES       a 502 (before the first token) or an error
                                                      event ending the stream (after)

A body is read in the chunks the socket gives and dropped once past its cap: memory stays
bounded by the cap, whatever the worker sends or claims in Content-Length. The router asks for
answers without content coding (`Accept-Encoding: identity`) and refuses a coded one, so a cap
counts the bytes that are kept, not a compressed size that could expand a thousandfold.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import httpx

HEALTH_BODY_BYTES = 64 << 10
SMALL_BODY_BYTES = 64 << 10
TOKENIZER_BODY_BYTES = 128 << 20  # a 9B model's tokenizer.json is ~17 MB; base64 adds a third
ANSWER_BODY_BYTES = 256 << 20  # echoed prompt logprobs of a long prompt are the large case
SSE_LINE_BYTES = 4 << 20  # one event: a token of each choice, with its top logprobs
PARSE_IN_THREAD_BYTES = 1 << 20  # larger JSON is parsed off the event loop
NO_CODING = {"Accept-Encoding": "identity"}  # the router's requests to workers carry it


class BadAnswer(ValueError):
    """A worker's answer the router cannot use: too large, content-coded, not JSON."""


class Answer(NamedTuple):
    status: int
    body: bytes


def _check_coding(response: httpx.Response, what: str) -> None:
    coding = response.headers.get("content-encoding", "identity").strip().lower()
    if coding not in ("", "identity"):
        raise BadAnswer(f"{what} came with Content-Encoding {coding!r}; the router asks for none")


async def read_body(response: httpx.Response, limit: int, what: str) -> bytes:
    """The body of a streamed `response`, at most `limit` bytes (BadAnswer past it, without
    reading on). The caller closes the response."""
    _check_coding(response, what)
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadAnswer(f"{what} is {int(declared)} bytes, more than the {limit} the router reads")
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise BadAnswer(f"{what} is more than the {limit} bytes the router reads")
    return bytes(body)


async def exchange(
    client: httpx.AsyncClient, request: httpx.Request, limit: int, what: str
) -> Answer:
    """Send `request` and read its answer within `limit` (an error answer within
    SMALL_BODY_BYTES); the connection is closed when this returns or is cancelled (the worker
    then aborts what it was doing for it)."""
    response = await client.send(request, stream=True)
    try:
        cap = limit if response.status_code == 200 else min(limit, SMALL_BODY_BYTES)
        return Answer(response.status_code, await read_body(response, cap, what))
    finally:
        await response.aclose()


async def get(client: httpx.AsyncClient, url: str, limit: int, what: str) -> Answer:
    """GET `url`, its body read within `limit`."""
    return await exchange(client, client.build_request("GET", url, headers=NO_CODING), limit, what)


async def parse_json(body: bytes, what: str) -> Any:
    """A worker's JSON (BadAnswer when it is not: cut short, not UTF-8, nested past what the
    parser allows)."""
    try:
        if len(body) >= PARSE_IN_THREAD_BYTES:
            return await asyncio.to_thread(json.loads, body)
        return json.loads(body)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, UnicodeDecodeError
        preview = body[:80].decode("utf-8", "replace")
        raise BadAnswer(
            f"{what} is not JSON ({type(error).__name__}: {str(error)[:200]}; "
            f"it starts {preview!r})"
        ) from None


async def sse_lines(response: httpx.Response, what: str) -> AsyncIterator[str]:
    """The lines of a streamed answer (LF or CRLF ended), each at most SSE_LINE_BYTES of UTF-8
    (BadAnswer otherwise): httpx's own line reader keeps a line that never ends."""
    _check_coding(response, what)
    pending = bytearray()
    async for chunk in response.aiter_bytes():
        pending += chunk
        start = 0
        while (end := pending.find(b"\n", start)) >= 0:
            yield _line(pending[start:end], what)
            start = end + 1
        del pending[:start]
        if len(pending) > SSE_LINE_BYTES:
            raise BadAnswer(f"{what}: a line longer than {SSE_LINE_BYTES} bytes")
    if pending:
        yield _line(pending, what)


def _line(raw: bytearray, what: str) -> str:
    if len(raw) > SSE_LINE_BYTES:
        raise BadAnswer(f"{what}: a line longer than {SSE_LINE_BYTES} bytes")
    try:
        return raw.decode("utf-8").removesuffix("\r")
    except UnicodeDecodeError as error:
        raise BadAnswer(f"{what}: a line that is not UTF-8 ({error})") from None
