"""POST /v1/completions: prompts as text, lists of text, token ids or lists of token ids."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from server.generation import (
    ChoiceResult,
    ServerState,
    admit,
    check_disagg,
    check_model,
    collect,
    fan_out,
    new_request_id,
    sse,
    sse_guard,
    timed_deltas,
    usage,
)
from server.logprobs import completion_logprobs
from server.protocol import CompletionRequest
from server.sampling import build_sampling_params, check_prompt
from server.validation import check_generation, requested_max_tokens

router = APIRouter()


def tokenize_prompts(
    state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    """Runs in a worker thread (the fast tokenizer releases the GIL while it encodes)."""
    if isinstance(prompt, str):
        return [state.tokenizer.encode(prompt)]
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]
    return [
        state.tokenizer.encode(item) if isinstance(item, str) else list(item) for item in prompt
    ]


def _has_text(prompt: str | list[str] | list[int] | list[list[int]]) -> bool:
    return isinstance(prompt, str) or any(isinstance(item, str) for item in prompt)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw_request: Request):
    state: ServerState = raw_request.app.state.baton
    arrival = time.monotonic()
    check_model(state, body.model)
    check_generation(body)  # the rules the router applies too, before any tokenizing
    if _has_text(body.prompt):
        prompts = await asyncio.to_thread(tokenize_prompts, state, body.prompt)
    else:  # token ids only: nothing to encode, so no worker-thread round trip (two loop wakeups)
        prompts = tokenize_prompts(state, body.prompt)
    max_tokens = requested_max_tokens(body)
    assert max_tokens is not None  # completions default to 16
    params = build_sampling_params(
        body, max_tokens=max_tokens, logprobs=body.logprobs, vocab_size=state.vocab_size
    )
    for prompt in prompts:
        check_prompt(
            prompt,
            max_tokens,
            vocab_size=state.vocab_size,
            max_model_len=state.max_model_len,
            param="prompt",
        )
    check_disagg(state, body.baton_disagg)
    admit(state)
    request_id = new_request_id("cmpl")
    requests = fan_out(request_id, prompts, params, body.n, body.baton_disagg)
    head = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": state.args.model_name,
    }
    if body.stream:
        chunks = _stream(state, body, head, prompts, requests, arrival)
        return StreamingResponse(sse_guard(chunks), media_type="text/event-stream")
    results = await collect(state, requests, arrival, raw_request)
    choices = [
        {
            "index": index,
            "text": result.text,
            "logprobs": _logprobs(state, body, result.token_ids, result.logprobs, 0),
            "finish_reason": result.finish_reason,
        }
        for index, result in enumerate(results)
    ]
    return {**head, "choices": choices, "usage": usage(prompts, results, body.n)}


def _logprobs(
    state: ServerState, body: CompletionRequest, token_ids, logprobs, text_offset: int
) -> dict | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(state.tokenizer, token_ids, logprobs, text_offset)


async def _stream(
    state: ServerState, body: CompletionRequest, head: dict, prompts, requests, arrival: float
) -> AsyncIterator[str]:
    results = [ChoiceResult() for _ in requests]
    extra = {"usage": None} if body.include_usage else {}
    async with contextlib.aclosing(timed_deltas(state, requests, arrival)) as deltas:
        async for index, delta in deltas:
            result = results[index]
            text_offset = len(result.text)
            result.add(delta)
            wants_logprobs = body.logprobs is not None and bool(delta.new_token_ids)
            if not (delta.new_text or delta.finished or wants_logprobs):
                continue
            choice = {
                "index": index,
                "text": delta.new_text,
                "logprobs": _logprobs(
                    state, body, delta.new_token_ids, delta.new_logprobs or [], text_offset
                ),
                "finish_reason": delta.finish_reason if delta.finished else None,
            }
            if body.continuous_usage:
                extra = {"usage": usage(prompts, results, body.n)}
            yield sse({**head, "choices": [choice], **extra})
    if body.include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompts, results, body.n)})
