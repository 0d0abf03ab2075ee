"""POST /v1/completions: prompts as text, lists of text, token ids or lists of token ids."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from baton.server.engine_client import EngineRequest
from baton.server.errors import APIError
from baton.server.openai.generation import (
    ChoiceResult,
    ServerState,
    admit,
    answered_model,
    check_disagg,
    check_model,
    collect,
    fan_out,
    new_request_id,
    sse,
    sse_guard,
    timed_deltas,
    usage,
    with_adapter,
)
from baton.server.openai.logprobs import completion_logprobs
from baton.server.openai.protocol import CompletionRequest
from baton.server.openai.sampling import build_sampling_params, params_for_prompt, truncate_prompt
from baton.server.openai.structured import checked_structured, structured_source
from baton.server.openai.validation import check_generation, engine_max_tokens, requested_max_tokens

router = APIRouter()


def tokenize_prompts(state: ServerState, body: CompletionRequest) -> list[list[int]]:
    """Runs in a worker thread (the fast tokenizer releases the GIL while it encodes); each
    prompt cut to `truncate_prompt_tokens` when the request asks, else refused as soon as it is
    proved too long for the context (Tokenizer.encode's limit)."""
    prompt = body.prompt
    if isinstance(prompt, str) or all(isinstance(item, int) for item in prompt):
        prompt = [prompt]
    special = body.add_special_tokens
    side = body.truncation_side
    keep = body.truncate_prompt_tokens
    # a prompt that will be cut may be any length; any other needs room for one token
    limit = None if keep is not None else state.max_model_len - 1
    prompts = [
        state.tokenizer.encode(item, special, limit, "prompt")
        if isinstance(item, str)
        else list(item)
        for item in prompt
    ]
    return [truncate_prompt(ids, keep, side, state.max_model_len) for ids in prompts]


def _has_text(prompt: str | list[str] | list[int] | list[list[int]]) -> bool:
    return isinstance(prompt, str) or any(isinstance(item, str) for item in prompt)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, raw_request: Request):
    state: ServerState = raw_request.app.state.baton
    arrival = time.monotonic()
    check_model(state, body.model)
    check_generation(body)  # the rules the router applies too, before any tokenizing
    started = await start_completion(state, body, "cmpl")
    prompts, requests, echo = started.prompts, started.requests, started.echo
    head = {
        "id": started.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": answered_model(state, body.model),
    }
    if body.stream:
        chunks = _stream(state, body, head, prompts, requests, arrival, echo)
        return StreamingResponse(sse_guard(chunks), media_type="text/event-stream")
    results = await collect(state, requests, arrival, raw_request)
    choices = []
    for index, result in enumerate(results):
        if echo is not None and echo.drop:
            echo.trim(result)
        choice = {
            "index": index,
            "text": result.text,
            "logprobs": _logprobs(state, body, result.token_ids, result.logprobs, 0),
            "finish_reason": result.finish_reason,
            "stop_reason": result.stop_reason,
        }
        if body.return_token_ids:
            choice["prompt_token_ids"] = prompts[index // body.n]
            choice["token_ids"] = result.token_ids
        choices.append(echo.prepend(index, result, choice) if echo is not None else choice)
    return {**head, "choices": choices, "usage": usage(prompts, results, body.n)}


@dataclass(frozen=True, kw_only=True, slots=True)
class StartedCompletion:
    prompts: list[list[int]]
    requests: list[EngineRequest]
    request_id: str
    echo: Echo | None


async def start_completion(
    state: ServerState,
    body: CompletionRequest,
    id_prefix: str,
    prompt_logprobs: bool = False,
    fit_to_context: bool = True,
) -> StartedCompletion:
    """Tokenize a checked completions request, check it against the model, admit it and fan it
    out into engine requests (shared with SGLang's /generate, which is one). The prompt's
    logprobs are computed for echo with logprobs, or when `prompt_logprobs` asks for them;
    `fit_to_context` is params_for_prompt's (off for /generate, which refuses as SGLang does)."""
    if _has_text(body.prompt):
        prompts = await asyncio.to_thread(tokenize_prompts, state, body)
    else:  # token ids only: nothing to encode, so no worker-thread round trip (two loop wakeups)
        prompts = tokenize_prompts(state, body)
    requested = requested_max_tokens(body)
    assert requested is not None  # completions default to 16
    max_tokens = engine_max_tokens(body, requested)
    scored = (body.echo or prompt_logprobs) and body.logprobs is not None
    params = build_sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=body.logprobs,
        vocab_size=state.vocab_size,
        prompt_logprobs=body.logprobs if scored else None,
    )
    params = with_adapter(state, body.model, params)
    # a bad spec: 400, no compute; the engine compiles the lowered one
    params = await checked_structured(params, structured_source(body))
    # one set per prompt: each gets the max_tokens its own length leaves in the context
    prompt_params = [
        params_for_prompt(
            params,
            prompt,
            max_tokens,
            vocab_size=state.vocab_size,
            max_model_len=state.max_model_len,
            param="prompt",
            fit_to_context=fit_to_context,
        )
        for prompt in prompts
    ]
    check_disagg(state, body.baton_disagg)
    if scored and body.baton_disagg is not None:
        raise APIError.bad_request(
            "the prompt's logprobs (echo with logprobs, or /generate's logprob_start_len) cannot "
            "be split between prefill and decode (they are not handed over); `baton router` "
            "sends such a request to one worker whole",
            "echo" if body.echo else "logprob_start_len",
        )
    # (token-id prompts are decoded for echo: off the event loop, as tokenizing is)
    echo = (
        await asyncio.to_thread(Echo, body, prompts, state, requested == 0) if body.echo else None
    )
    admit(state)
    request_id = new_request_id(id_prefix)
    requests = fan_out(request_id, prompts, prompt_params, body.n, body.baton_disagg)
    return StartedCompletion(prompts=prompts, requests=requests, request_id=request_id, echo=echo)


class Echo:
    """`echo`: each choice's text starts with its prompt's (as given, or its ids decoded), and
    with logprobs its prompt tokens' logprobs come first (the first one null, as in vLLM). With
    max_tokens 0 (`drop`) the one generated token is not returned: the prompt is only scored."""

    def __init__(
        self, body: CompletionRequest, prompts: list[list[int]], state: ServerState, drop: bool
    ) -> None:
        self.body = body
        self.state = state
        self.drop = drop
        self.prompt_ids = prompts
        given = body.prompt
        items = (
            [given]
            if isinstance(given, str) or all(isinstance(item, int) for item in given)
            else given
        )
        # a prompt as given, unless it was cut (truncate_prompt_tokens): then what was kept
        self.texts = [
            item
            if isinstance(item, str) and body.truncate_prompt_tokens is None
            else state.tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens)
            for item, ids in zip(items, prompts, strict=True)
        ]

    def prompt_of(self, index: int) -> int:
        return index // self.body.n

    @staticmethod
    def trim(result: ChoiceResult) -> None:
        result.text, result.token_ids, result.logprobs = "", [], []
        result.finish_reason = "length"

    def prepend(self, index: int, result: ChoiceResult, choice: dict) -> dict:
        """The choice (or the first chunk of its stream) with its prompt in front."""
        prompt = self.prompt_of(index)
        text = self.texts[prompt]
        logprobs = choice["logprobs"]
        if logprobs is not None:
            ids = self.prompt_ids[prompt]
            # one entry per prompt token (the engine recomputes them after a preemption); the
            # padding only guards the response's shape
            entries = list(result.prompt_logprobs or [])[: len(ids)]
            entries += [None] * (len(ids) - len(entries))
            head = completion_logprobs(self.state.tokenizer, ids, entries, 0)
            for key in ("tokens", "token_logprobs", "top_logprobs"):
                head[key] += logprobs[key]
            head["text_offset"] += [offset + len(text) for offset in logprobs["text_offset"]]
            logprobs = head
        return {**choice, "text": text + choice["text"], "logprobs": logprobs}


def _logprobs(
    state: ServerState, body: CompletionRequest, token_ids, logprobs, text_offset: int
) -> dict | None:
    if body.logprobs is None:
        return None
    return completion_logprobs(state.tokenizer, token_ids, logprobs, text_offset)


async def _stream(
    state: ServerState,
    body: CompletionRequest,
    head: dict,
    prompts,
    requests,
    arrival: float,
    echo: Echo | None,
) -> AsyncIterator[str]:
    results = [ChoiceResult() for _ in requests]
    extra = {"usage": None} if body.include_usage else {}
    echoed: set[int] = set()
    ids_sent: set[int] = set()  # return_token_ids: choices whose prompt ids went out

    def token_ids(index: int, new_token_ids: list[int]) -> dict:
        """return_token_ids (vLLM's): the prompt's ids on a choice's first chunk, then null;
        every chunk its new ids."""
        if not body.return_token_ids:
            return {}
        first = index not in ids_sent
        ids_sent.add(index)
        prompt_ids = prompts[index // body.n] if first else None
        return {"prompt_token_ids": prompt_ids, "token_ids": new_token_ids}

    async with contextlib.aclosing(timed_deltas(state, requests, arrival)) as deltas:
        async for index, delta in deltas:
            result = results[index]
            text_offset = len(result.text)
            result.add(delta)
            if echo is not None and echo.drop:
                echo.trim(result)
            if echo is not None and index not in echoed:
                # the prompt first, in a chunk of its own (with the generated text when dropped)
                echoed.add(index)
                lead = {
                    "index": index,
                    "text": "",
                    "logprobs": _logprobs(state, body, [], [], 0),
                    "finish_reason": result.finish_reason if echo.drop else None,
                    "stop_reason": result.stop_reason if echo.drop else None,
                    **token_ids(index, []),
                }
                if body.continuous_usage:
                    extra = {"usage": usage(prompts, results, body.n)}
                yield sse({**head, "choices": [echo.prepend(index, result, lead)], **extra})
            if echo is not None:
                if echo.drop:
                    continue
                text_offset += len(echo.texts[echo.prompt_of(index)])
            wants_ids = (body.logprobs is not None or body.return_token_ids) and bool(
                delta.new_token_ids
            )
            if not (delta.new_text or delta.finished or wants_ids):
                continue
            choice = {
                "index": index,
                "text": delta.new_text,
                "logprobs": _logprobs(
                    state, body, delta.new_token_ids, delta.new_logprobs or [], text_offset
                ),
                "finish_reason": delta.finish_reason if delta.finished else None,
                "stop_reason": delta.stop_reason if delta.finished else None,
                **token_ids(index, delta.new_token_ids),
            }
            if body.continuous_usage:
                extra = {"usage": usage(prompts, results, body.n)}
            yield sse({**head, "choices": [choice], **extra})
    if body.include_usage:
        yield sse({**head, "choices": [], "usage": usage(prompts, results, body.n)})
