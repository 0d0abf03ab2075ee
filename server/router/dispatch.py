"""One request through the router: tries on worker pairs until one commits, bounded.

    pick a pair (each side by its policy; workers that failed this request avoided)
      └─> try it (router/relay.py) ──> committed: the answer goes to the client, done
                                   ├─> the client's fault (400...), or the client left: done
                                   └─> the workers' fault before any byte reached the client
                                       (refused, reset, 503, a failed handover, a broken answer,
                                       no first token by the deadline: router/failures.py):
                                       count it on the worker's circuit, wait (backoff), try
                                       another pair

A try that already sent the client a byte is never tried again, so the client never sees a
duplicate or a mixed stream: a stream is held back until it carries output (a chat stream's role
chunks too), and a failure after that ends the stream with an error event, as before.
"""

from __future__ import annotations

import asyncio
import logging
import random
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask

from baton.server.router.answers import (
    ANSWER_BODY_BYTES,
    SMALL_BODY_BYTES,
    BadAnswer,
    exchange,
    parse_json,
    read_body,
)
from baton.server.router.args import RetryArgs
from baton.server.router.failures import Failure, FirstByte, error_response, worker_error_body
from baton.server.router.relay import (
    Committed,
    cancel,
    decode_headers,
    first_output,
    forward_headers,
    prefill_failure,
    relay,
)
from baton.server.router.workers import Worker, WorkerSet

logger = logging.getLogger("baton.router")

NO_PAIR = "no healthy prefill + decode worker pair"
# How long a decode worker's failure waits for its prefill half to fail too (see `_blame`).
PREFILL_GRACE_S = 1.0


def scores_prompt(path: str, body: dict) -> bool:
    """A request that wants its prompt's logprobs back: completions' echo with logprobs,
    SGLang's return_logprob with a logprob_start_len."""
    if path == "/generate":
        return body.get("return_logprob") is True and body.get("logprob_start_len", -1) >= 0
    return (
        path == "/v1/completions" and body.get("echo") is True and body.get("logprobs") is not None
    )


def _settle(task: asyncio.Future, workers: WorkerSet, prefill: Worker) -> None:
    """The prefill half ended: its place is given back, and an error nobody waits for any more
    (the stream had committed) is read here, not reported as never retrieved."""
    workers.end(prefill)
    if not task.cancelled():
        task.exception()


def once(action: Callable[[], None]) -> Callable[[], None]:
    """`action` wrapped so that only its first call runs."""
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return run


@dataclass
class Dispatcher:
    workers: WorkerSet
    client: httpx.AsyncClient  # request traffic
    retry: RetryArgs
    rng: random.Random
    first_byte_timeout_s: float  # --worker-first-byte-timeout-secs

    async def serve(
        self,
        request: Request,
        path: str,
        body: dict,
        prompt: Sequence[int] | None,
        release: Callable[[], None],
    ) -> Response:
        """The client's answer. `release` gives back the admission place: called here unless
        the answer is a stream, whose end calls it."""
        avoid: set[str] = set()
        failure: Failure | None = None
        for attempt in range(self.retry.max_retries + 1):
            pair = self.workers.pick_pair(prompt, frozenset(avoid))
            if pair is None:
                break
            outcome = await self.attempt(request, path, body, pair, release)
            if not isinstance(outcome, Failure):
                return outcome
            if not outcome.retryable:
                return outcome.response
            self.workers.failed(outcome.worker, outcome.reason)
            failure = outcome
            avoid |= {worker.url for worker in pair}
            if attempt < self.retry.max_retries:
                self.workers.retried(outcome.worker)
                logger.warning("retrying a request elsewhere: %s", outcome.reason)
                await asyncio.sleep(self.backoff(attempt))
        return failure.response if failure is not None else error_response(503, NO_PAIR)

    def backoff(self, attempt: int) -> float:
        """Seconds before try `attempt + 2`: doubling from the initial wait, capped, +-20% so
        that requests failed together do not come back together."""
        wait = min(self.retry.max_backoff_s, self.retry.initial_backoff_s * 2**attempt)
        return wait * self.rng.uniform(0.8, 1.2)

    async def attempt(
        self,
        request: Request,
        path: str,
        body: dict,
        pair: tuple[Worker, Worker],
        release: Callable[[], None],
    ) -> Response | Failure:
        prefill, decode = pair
        client, workers = self.client, self.workers
        headers = forward_headers(request)
        if scores_prompt(path, body):
            # echo with logprobs (prompt scoring, lm-evaluation-harness's loglikelihood) needs
            # the prompt's logprobs, which no handover carries: the prefill worker serves the
            # whole request itself, colocated (a prefill is all such a request is). No prefill
            # half runs beside it: its task is a future that never completes.
            decode, decode_body = prefill, body
            prefill_task: asyncio.Future = asyncio.get_running_loop().create_future()
        else:
            room = uuid.uuid4().hex  # minted here; a client's value is never trusted
            decode_body = dict(
                body,
                baton_disagg={
                    "room": room,
                    "prefill_addr": prefill.transfer_addr,
                    "prefill_addr_token": prefill.transfer_addr_token,
                },
            )
            prefill_body = dict(body, stream=False, baton_disagg={"room": room})
            prefill_body.pop("stream_options", None)
        # Both requests are built (encoded) before either is sent: one that cannot be leaves no
        # task of the other behind.
        decode_request = client.build_request(
            "POST", f"{decode.url}{path}", json=decode_body, headers=headers
        )
        if decode is not prefill:
            prefill_request = client.build_request(
                "POST", f"{prefill.url}{path}", json=prefill_body, headers=headers
            )
            workers.begin(prefill)
            what = f"prefill worker {prefill.url}'s answer"
            prefill_task = asyncio.ensure_future(
                exchange(client, prefill_request, ANSWER_BODY_BYTES, what)
            )
            prefill_task.add_done_callback(lambda task: _settle(task, workers, prefill))
        workers.begin(decode)
        end_decode = once(lambda: workers.end(decode))
        first_byte = FirstByte.starting_now(self.first_byte_timeout_s)
        sending = asyncio.ensure_future(client.send(decode_request, stream=True))
        stream = bool(body.get("stream"))
        try:
            stopped = await decode_headers(
                request, sending, prefill_task, (prefill, decode), workers, first_byte, stream
            )
            if stopped is not None:
                await cancel(sending)
                return await self._abandon(stopped, prefill, prefill_task, end_decode)
            upstream = sending.result()
        except httpx.HTTPError as error:
            return await self._abandon(
                Failure.unreachable(decode, error, workers), prefill, prefill_task, end_decode
            )
        what = f"{decode.role} worker {decode.url}'s answer"
        if upstream.status_code != 200:
            try:
                content = await read_body(upstream, SMALL_BODY_BYTES, what)
                failure = Failure.answered(
                    decode,
                    upstream.status_code,
                    worker_error_body(upstream.status_code, content.decode(errors="replace")),
                )
            except BadAnswer as error:
                failure = Failure.malformed(decode, error)
            except httpx.HTTPError as error:
                failure = Failure.unreachable(decode, error, workers)
            finally:
                await upstream.aclose()
            return await self._abandon(failure, prefill, prefill_task, end_decode)
        if stream:
            outcome = await first_output(
                request, upstream, prefill_task, (prefill, decode), workers, first_byte
            )
            if not isinstance(outcome, Committed):
                await upstream.aclose()
                return await self._abandon(outcome, prefill, prefill_task, end_decode)
            self._succeeded(prefill, decode)
            finish = once(lambda: (release(), end_decode(), prefill_task.cancel()))
            return StreamingResponse(
                relay(outcome, upstream, decode, workers, finish),
                media_type="text/event-stream",
                # Also when the client left before the first chunk and the relay never ran.
                background=BackgroundTask(finish),
            )
        try:
            content = await read_body(upstream, ANSWER_BODY_BYTES, what)
            await parse_json(content, what)  # cut short or garbled: never a 200 to the client
        except httpx.HTTPError as error:
            return await self._abandon(
                Failure.unreachable(decode, error, workers), prefill, prefill_task, end_decode
            )
        except BadAnswer as error:
            failure = Failure.malformed(decode, error)
            return await self._abandon(failure, prefill, prefill_task, end_decode)
        finally:
            await upstream.aclose()
        end_decode()
        self._succeeded(prefill, decode)
        return Response(content, status_code=200, media_type="application/json")

    async def _abandon(
        self,
        outcome: Failure | Response,
        prefill: Worker,
        prefill_task: asyncio.Future,
        end_decode: Callable[[], None],
    ) -> Failure | Response:
        """A try that ends before the client got anything: close its prefill half (the worker
        aborts it) and give the decode worker's place back. A decode worker's failure while the
        prefill half still runs is often the prefill worker's (one that dies fails the handover
        on the decode side first): if the prefill half fails too within PREFILL_GRACE_S, the
        failure is counted as its own, so the healthy decode worker's circuit stays closed."""
        suspect = isinstance(outcome, Failure) and outcome.retryable
        if suspect and outcome.worker is not prefill and not prefill_task.done():
            await asyncio.wait({prefill_task}, timeout=PREFILL_GRACE_S)
            outcome = prefill_failure(prefill_task, prefill, self.workers) or outcome
        prefill_task.cancel()
        end_decode()
        if isinstance(outcome, Failure) and not outcome.retryable:
            return outcome.response
        return outcome

    def _succeeded(self, prefill: Worker, decode: Worker) -> None:
        self.workers.succeeded(decode)
        if prefill is not decode:
            self.workers.succeeded(prefill)
