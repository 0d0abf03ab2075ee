"""What /v1/completions and /v1/chat/completions share: admission, fan-out, timing, collection.

One HTTP request becomes len(prompts) x n engine requests ("choices"), numbered
`prompt_index * n + sample_index`, each with id f"{request_id}-{choice}" and, when a seed is
given, seed + sample_index (so n samples differ but a rerun repeats them).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request

from baton.disagg.address_token import vouched
from baton.engine.core.outputs import RequestDelta, TokenLogprobs
from baton.engine.core.sampling_params import SamplingParams
from baton.server.args import ServerArgs
from baton.server.engine_client import (
    EngineClient,
    EngineRejected,
    EngineRequest,
    EngineUnavailable,
    RequestFailedServerSide,
)
from baton.server.errors import APIError, error_body
from baton.server.metrics import ServerMetrics
from baton.server.openai.protocol import DisaggField
from baton.server.tokenizer import Tokenizer


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerState:
    args: ServerArgs
    client: EngineClient
    tokenizer: Tokenizer
    metrics: ServerMetrics

    @property
    def vocab_size(self) -> int:
        assert self.client.ready is not None
        return self.client.ready.vocab_size

    @property
    def max_model_len(self) -> int:
        assert self.client.ready is not None
        return self.client.ready.max_model_len


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: ServerState, model: str | None) -> None:
    """404 for a model this server does not serve (omitting `model` means the served one); a
    LoRA adapter's name is a model it serves."""
    if model is not None and model in state.client.adapters:
        return
    if model is not None and model not in (state.args.model_name, state.args.model):
        raise APIError(
            404,
            f"The model `{model}` does not exist; this server serves `{state.args.model_name}`.",
            "model",
            "model_not_found",
        )


def answered_model(state: ServerState, model: str | None) -> str:
    """The `model` an answer names: the adapter's when the request named one (vLLM's)."""
    return model if model is not None and model in state.client.adapters else state.args.model_name


def with_adapter(state: ServerState, model: str | None, params: SamplingParams) -> SamplingParams:
    """The request's params under the adapter its `model` names (unchanged for the base)."""
    if model is None or model not in state.client.adapters:
        return params
    return dataclasses.replace(params, lora_name=model)


def check_disagg(state: ServerState, disagg: DisaggField | None) -> None:
    """Room fields only make sense on a disaggregated worker (which, without them, simply
    serves the request itself, colocated). A decode worker with a secret takes only prefill
    addresses a prefill worker vouched for (disagg/address_token.py)."""
    mode = state.args.disaggregation_mode
    if disagg is not None and mode is None:
        raise APIError.bad_request(
            "this worker is not part of a disaggregated pair", "baton_disagg"
        )
    if disagg is not None and mode == "decode" and not disagg.prefill_addr:
        raise APIError.bad_request(
            "a decode worker needs baton_disagg.prefill_addr", "baton_disagg"
        )
    secret = state.args.worker_secret
    if disagg is not None and mode == "decode" and secret is not None:
        if not vouched(secret, disagg.prefill_addr, disagg.prefill_addr_token):
            raise APIError.bad_request(
                "baton_disagg.prefill_addr is not vouched for by a prefill worker holding this"
                " worker's --disagg-secret: baton_disagg.prefill_addr_token must be the"
                " transfer_addr_token of that worker's /disagg/info (baton router passes it on)",
                "baton_disagg.prefill_addr_token",
            )


def admit(state: ServerState) -> None:
    """503 while the engine is unavailable or its waiting queue is full."""
    if not state.client.alive:
        raise APIError(503, f"engine unavailable: {state.client.unavailable_reason}")
    limit = state.args.max_queued_requests
    waiting = state.client.num_waiting()
    if limit is not None and waiting >= limit:
        raise APIError(
            503,
            f"the waiting queue is full ({waiting} requests waiting, --max-queued-requests {limit}); retry later",
            code="queue_full",
        )


def fan_out(
    request_id: str,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    n: int,
    disagg: DisaggField | None = None,
) -> list[EngineRequest]:
    """`params`: one set for every prompt, or one per prompt. Each choice of a disaggregated
    request gets its own room, f"{room}-{choice}", which the prefill and the decode worker
    derive the same way."""
    per_prompt = params if isinstance(params, list) else [params] * len(prompts)
    requests = []
    for prompt_index, (prompt, prompt_params) in enumerate(zip(prompts, per_prompt, strict=True)):
        for sample in range(n):
            sample_params = (
                prompt_params
                if prompt_params.seed is None
                else dataclasses.replace(prompt_params, seed=prompt_params.seed + sample)
            )
            choice = prompt_index * n + sample
            requests.append(
                EngineRequest(
                    request_id=f"{request_id}-{choice}",
                    prompt_token_ids=prompt,
                    params=sample_params,
                    room=f"{disagg.room}-{choice}" if disagg else "",
                    prefill_addr=(disagg.prefill_addr or "") if disagg else "",
                )
            )
    return requests


async def timed_deltas(
    state: ServerState, requests: list[EngineRequest], arrival: float
) -> AsyncIterator[tuple[int, RequestDelta]]:
    """The engine's deltas for `requests`, recording TTFT, ITL and e2e latency on the way."""
    metrics = state.metrics
    last_output: dict[int, float] = {}
    async with contextlib.aclosing(state.client.generate(requests, state.tokenizer.hf)) as deltas:
        async for index, delta in deltas:
            now = time.monotonic()
            if delta.new_token_ids:
                if index not in last_output:
                    metrics.time_to_first_token.observe(now - arrival)
                else:
                    gap = (now - last_output[index]) / len(delta.new_token_ids)
                    for _ in delta.new_token_ids:
                        metrics.inter_token_latency.observe(gap)
                last_output[index] = now
            if delta.finished:
                metrics.e2e_latency.observe(now - arrival)
                metrics.finished.labels(delta.finish_reason or "abort").inc()
            yield index, delta


@dataclass(kw_only=True)
class ChoiceResult:
    """Everything one engine request produced, accumulated from its deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # when the request asked for them
    stop_reason: str | int | None = None  # the stop string or token id that ended it

    def add(self, delta: RequestDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text += delta.new_text
        self.token_ids.extend(delta.new_token_ids)
        self.logprobs.extend(delta.new_logprobs or [])
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def collect(
    state: ServerState, requests: list[EngineRequest], arrival: float, http_request: Request
) -> list[ChoiceResult]:
    """Run the requests to completion; a client that hangs up aborts them (499, unsent)."""
    results = [ChoiceResult() for _ in requests]

    async def run() -> None:
        async for index, delta in timed_deltas(state, requests, arrival):
            results[index].add(delta)

    work = asyncio.ensure_future(run())
    hangup = asyncio.ensure_future(_wait_for_disconnect(http_request))
    await asyncio.wait({work, hangup}, return_when=asyncio.FIRST_COMPLETED)
    hangup.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise APIError(499, "client closed the request")
    try:
        work.result()
    except EngineRejected as error:
        raise APIError.bad_request(str(error)) from error
    except RequestFailedServerSide as error:
        raise APIError(503, str(error)) from error
    except EngineUnavailable as error:
        raise APIError(503, f"engine unavailable: {error}") from error
    return results


def usage(prompts: list[list[int]], results: list[ChoiceResult], n: int) -> dict:
    """Prompt tokens count once per prompt, however many samples were drawn from it."""
    prompt_tokens = sum(len(prompt) for prompt in prompts)
    completion_tokens = sum(len(result.token_ids) for result in results)
    cached = sum(
        results[prompt_index * n].num_cached_tokens for prompt_index in range(len(prompts))
    )
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def sse_guard(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """End every stream with `data: [DONE]`; a failure mid-stream becomes an error event first."""
    try:
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk
    except EngineRejected as error:
        yield sse(error_body(400, str(error)))
    except RequestFailedServerSide as error:
        yield sse(error_body(503, str(error)))
    except EngineUnavailable as error:
        yield sse(error_body(503, f"engine unavailable: {error}"))
    yield sse("[DONE]")
