"""What a failed try of a request is, and what the client gets for it (OpenAI's error shape).

    the worker could not be reached, or dropped the connection    503, retryable (GONE: out of
                                                                  rotation at once)
    the worker answered an error                                  its status and error, but a
                                                                  500 or a redirect is a 502;
                                                                  retryable when it is a 503
    the worker's answer was broken (cut short, not JSON, too big) 502, retryable
    the worker owed the first token and sent none in time         504, retryable

Retryable failures are the workers' own: they count on the worker's circuit and the request is
tried on another pair, as long as no byte has reached the client. A 4xx (and a worker's 500,
which a client's input may cause) is never retried nor counted: one client must not be able to
open every worker's circuit.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx
from fastapi.responses import JSONResponse, Response

from baton.server.errors import ErrorJSONResponse
from baton.server.router.answers import BadAnswer
from baton.server.router.workers import Worker, WorkerSet, describe


def error_body(status: int, message: str, code: str | None = None) -> dict:
    kind = (
        "invalid_request_error"
        if status < 500
        else "service_unavailable"
        if status == 503
        else "server_error"
        if status in (502, 504)  # a worker broke or was late (OpenAI's type for its own 5xx)
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


def passable(status: int) -> bool:
    """Whether a worker's status may reach the client as it is: success, the client's own
    mistakes (4xx), and the two statuses that say a worker is busy or late (503, 504)."""
    return 200 <= status < 300 or 400 <= status < 500 or status in (503, 504)


def worker_error_body(status: int, text: str) -> dict:
    """An error answer in the OpenAI shape: the worker's own (param, type and code kept), or
    its text as the message."""
    body = error_body(status, text)
    try:
        given = json.loads(text)["error"]
        body["error"].update(
            {key: given[key] for key in ("message", "type", "param", "code") if key in given}
        )
    except (ValueError, KeyError, TypeError, RecursionError):
        pass  # not the OpenAI error shape: its text is the message
    return body


@dataclass(frozen=True, kw_only=True)
class Failure:
    """A try that ended before any byte reached the client."""

    response: Response  # what the client gets if it is not tried again
    worker: Worker  # whose failure it is
    retryable: bool  # the worker's fault (refused, reset, 503): another pair may serve it
    reason: str  # for the log

    @classmethod
    def unreachable(cls, worker: Worker, error: httpx.HTTPError, workers: WorkerSet) -> Failure:
        if isinstance(error, GONE):
            workers.lost(worker, error)
        reason = f"{worker.role} worker {worker.url} failed: {describe(error)}"
        return cls(
            response=error_response(503, reason), worker=worker, retryable=True, reason=reason
        )

    @classmethod
    def answered(cls, worker: Worker, status: int, body: dict) -> Failure:
        """The worker's own error answer (OpenAI shape), marked as that worker's. A status no
        worker should send (a 500, a redirect) reaches the client as a 502: the router's own
        status says that a worker failed, whatever the worker's says."""
        reason = f"{worker.role} worker {worker.url} answered {status}: {body['error']['message']}"
        if status < 400 or not passable(status):  # (an error event may claim any code)
            body = error_body(502, reason[:2000])
            status = 502
        return cls(
            response=ErrorJSONResponse(body, status_code=status),
            worker=worker,
            retryable=status == 503,
            reason=reason[:500],
        )

    @classmethod
    def malformed(cls, worker: Worker, error: BadAnswer) -> Failure:
        """An answer the router cannot pass on (cut short, not JSON, too large): the worker is
        broken, so it counts on its circuit, and another pair may serve the request."""
        reason = f"{worker.role} worker {worker.url} sent a broken answer: {error}"
        return cls(
            response=error_response(502, reason), worker=worker, retryable=True, reason=reason
        )

    @classmethod
    def late(cls, worker: Worker, seconds: float, owed: str = "first token") -> Failure:
        reason = (
            f"{worker.role} worker {worker.url} sent no {owed} within {seconds:g} s "
            "(--worker-first-byte-timeout-secs)"
        )
        return cls(
            response=error_response(504, reason), worker=worker, retryable=True, reason=reason
        )


@dataclass(frozen=True, kw_only=True)
class FirstByte:
    """A try's first-byte deadline."""

    seconds: float
    at: float  # time.monotonic() when it passes

    @classmethod
    def starting_now(cls, seconds: float) -> FirstByte:
        return cls(seconds=seconds, at=time.monotonic() + seconds)

    def left(self) -> float:
        return max(0.0, self.at - time.monotonic())
