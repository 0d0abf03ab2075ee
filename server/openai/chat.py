"""POST /v1/chat/completions: messages through the tokenizer's chat template."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from baton.engine.core.sampling_params import SamplingParams
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
from baton.server.openai.logprobs import chat_logprobs
from baton.server.openai.protocol import ChatCompletionRequest
from baton.server.openai.sampling import build_sampling_params, params_for_prompt, truncate_prompt
from baton.server.openai.structured import checked_structured, structured_source
from baton.server.openai.tool_choice import ChatOutputPlan, plan_output, reasoning_end_ids
from baton.server.openai.validation import check_generation, num_logprobs, requested_max_tokens
from baton.server.parsers.blocks import text_end
from baton.server.parsers.output import OutputDelta, OutputStream, message_fields

router = APIRouter()


def _max_tokens(body: ChatCompletionRequest, prompt_len: int, max_model_len: int) -> int:
    """max_completion_tokens, else max_tokens, else whatever the context has left."""
    requested = requested_max_tokens(body)
    if requested is not None:
        return requested
    if prompt_len >= max_model_len:
        raise APIError.bad_request(
            f"messages: the prompt ({prompt_len} tokens) leaves no room within max-model-len ({max_model_len})",
            "messages",
        )
    return max_model_len - prompt_len


class PreparedChat(NamedTuple):
    prompt: list[int]
    params: SamplingParams
    plan: ChatOutputPlan


async def prepare_chat(state: ServerState, body: ChatCompletionRequest) -> PreparedChat:
    """The templated prompt, its sampling parameters and how the output is read (400 for what
    the model or the server's flags refuse); shared with /v1/responses."""
    check_model(state, body.model)
    check_generation(body)  # the rules the router applies too, before any tokenizing
    variables = body.template_variables()
    tokenizer = state.tokenizer
    tools = [
        {"type": "function", "function": tool.function.for_template()} for tool in body.tools or []
    ]
    text = await asyncio.to_thread(
        tokenizer.render_chat,
        body.messages,
        body.add_generation_prompt,
        variables,
        body.continue_final_message,
        tools or None,
    )
    plan = plan_output(body, state.args.parser_settings(), text, variables)
    prompt = await asyncio.to_thread(
        tokenizer.encode,
        text,
        body.add_special_tokens,
        # a prompt that will be cut may be any length; any other needs room for one token
        None if body.truncate_prompt_tokens is not None else state.max_model_len - 1,
        "messages",
    )
    prompt = truncate_prompt(
        prompt, body.truncate_prompt_tokens, body.truncation_side, state.max_model_len
    )
    max_tokens = _max_tokens(body, len(prompt), state.max_model_len)
    params = build_sampling_params(
        body, max_tokens=max_tokens, logprobs=num_logprobs(body), vocab_size=state.vocab_size
    )
    params = with_adapter(state, body.model, params)
    params = plan.sampling(params, reasoning_end_ids(tokenizer, plan.settings))
    # a bad spec: 400, no compute; the engine compiles the lowered one
    params = await checked_structured(params, structured_source(body))
    params = params_for_prompt(
        params,
        prompt,
        max_tokens,
        vocab_size=state.vocab_size,
        max_model_len=state.max_model_len,
        param="messages",
    )
    return PreparedChat(prompt=prompt, params=params, plan=plan)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, raw_request: Request):
    state: ServerState = raw_request.app.state.baton
    arrival = time.monotonic()
    prompt, params, plan = await prepare_chat(state, body)
    check_disagg(state, body.baton_disagg)
    admit(state)
    request_id = new_request_id("chatcmpl")
    requests = fan_out(request_id, [prompt], params, body.n, body.baton_disagg)
    head = {
        "id": request_id,
        "created": int(time.time()),
        "model": answered_model(state, body.model),
    }
    if body.stream:
        chunks = _stream(state, body, plan, head, prompt, requests, arrival)
        return StreamingResponse(sse_guard(chunks), media_type="text/event-stream")
    results = await collect(state, requests, arrival, raw_request)
    choices = [_choice(state, body, plan, index, result) for index, result in enumerate(results)]
    return {
        **head,
        "object": "chat.completion",
        "choices": choices,
        "usage": usage([prompt], results, body.n),
        # vLLM's return_token_ids: the templated prompt's ids
        **({"prompt_token_ids": prompt} if body.return_token_ids else {}),
    }


def _choice(
    state: ServerState, body: ChatCompletionRequest, plan: ChatOutputPlan, index: int, result
) -> dict:
    message: dict = {"role": "assistant", "content": result.text}
    finish_reason = result.finish_reason
    if plan.parses:
        parsed = plan.parser().parse(result.text, text_end(True, result.finish_reason))
        parsed = dataclasses.replace(parsed, calls=parsed.calls[: plan.max_calls])
        message.update(message_fields(parsed, None, has_reasoning_parser=plan.has_reasoning_parser))
        if not body.include_reasoning:
            message.pop("reasoning", None)
        finish_reason = plan.finish_reason(finish_reason, bool(parsed.calls))
    return {
        "index": index,
        "message": message,
        "logprobs": _logprobs(state, body, result.token_ids, result.logprobs),
        "finish_reason": finish_reason,
        "stop_reason": result.stop_reason,
        **({"token_ids": result.token_ids} if body.return_token_ids else {}),
    }


def _logprobs(state: ServerState, body: ChatCompletionRequest, token_ids, logprobs) -> dict | None:
    if not body.logprobs:
        return None
    return {"content": chat_logprobs(state.tokenizer, token_ids, logprobs, body.top_logprobs or 0)}


def _delta(plan: ChatOutputPlan, body: ChatCompletionRequest, parsed: OutputDelta) -> dict:
    """A parsed stream delta as OpenAI's chat delta (calls past parallel_tool_calls dropped)."""
    delta: dict = {}
    if parsed.reasoning and body.include_reasoning:
        delta["reasoning"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    calls = [call for call in parsed.tool_calls if call["index"] < (plan.max_calls or 1 << 30)]
    if calls:
        delta["tool_calls"] = calls
    return delta


async def _stream(
    state: ServerState,
    body: ChatCompletionRequest,
    plan: ChatOutputPlan,
    head: dict,
    prompt,
    requests,
    arrival: float,
) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    results = [ChoiceResult() for _ in requests]
    streams = [OutputStream(plan.parser()) if plan.parses else None for _ in requests]
    extra = {"usage": None} if body.include_usage else {}
    if body.continuous_usage:
        extra = {"usage": usage([prompt], results, body.n)}
    for index in range(len(requests)):
        # OpenAI opens each choice with the assistant role and no content.
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        prompt_ids = {"prompt_token_ids": prompt} if body.return_token_ids else {}
        yield sse({**head, "choices": [choice], **prompt_ids, **extra})
    async with contextlib.aclosing(timed_deltas(state, requests, arrival)) as deltas:
        async for index, delta in deltas:
            results[index].add(delta)
            wants_ids = (body.logprobs or body.return_token_ids) and bool(delta.new_token_ids)
            stream = streams[index]
            finish_reason = delta.finish_reason
            if stream is None:
                message = {"content": delta.new_text} if delta.new_text or wants_ids else {}
            else:
                end = text_end(delta.finished, delta.finish_reason)
                message = _delta(plan, body, stream.update(results[index].text, end))
                finish_reason = plan.finish_reason(finish_reason, bool(stream.call_ids))
            if not (message or delta.finished or wants_ids):
                continue
            choice = {
                "index": index,
                "delta": message,
                "logprobs": _logprobs(state, body, delta.new_token_ids, delta.new_logprobs or []),
                "finish_reason": finish_reason if delta.finished else None,
            }
            if body.return_token_ids:
                choice["token_ids"] = delta.new_token_ids
            if delta.finished:  # vLLM's: the stop string or token id that ended it, else null
                choice["stop_reason"] = delta.stop_reason
            if body.continuous_usage:
                extra = {"usage": usage([prompt], results, body.n)}
            yield sse({**head, "choices": [choice], **extra})
    if body.include_usage:
        yield sse({**head, "choices": [], "usage": usage([prompt], results, body.n)})
