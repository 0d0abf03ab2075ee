"""POST /v1/responses: OpenAI's Responses API over the chat pipeline (openai/responses/protocol.py
turns the request into a chat request; the answer is read by the same parsers).

An answer is a list of output items, in this order: a `reasoning` item (with a reasoning
parser), a `message` with one output_text part (when there is text), a `function_call` per
tool call. Streamed, the events are OpenAI's (openai/responses/events.py).
"""

from __future__ import annotations

import dataclasses
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from baton.engine.core.sampling_params import StructuredOutputs
from baton.server.errors import APIError
from baton.server.openai.chat import prepare_chat
from baton.server.openai.generation import (
    ServerState,
    admit,
    answered_model,
    check_disagg,
    collect,
    fan_out,
)
from baton.server.openai.responses.events import (
    call_item,
    finished_response,
    message_item,
    new_id,
    reasoning_item,
    response_events,
)
from baton.server.openai.responses.protocol import (
    ResponsesRequest,
    named_as_responses,
    to_chat_request,
)
from baton.server.openai.structured import checked_structured
from baton.server.openai.tool_choice import reasoning_end_ids
from baton.server.parsers.blocks import text_end
from baton.server.parsers.output import OutputStream, ParsedOutput

router = APIRouter()


def _text_format(body: ResponsesRequest, plan, end_ids: list[int]) -> StructuredOutputs | None:
    """text.format as a grammar on the answer (after the reasoning, as for chat)."""
    text_format = body.text.format if body.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if plan.named is not None or plan.tool_choice == "required":
        raise APIError.bad_request(
            "text.format cannot constrain an answer that tool_choice already forces to a call",
            "text",
        )
    after = tuple(end_ids) if plan.has_reasoning_parser and plan.thinking else ()
    if text_format.type == "json_object":
        return StructuredOutputs(kind="json_object", spec="", after_token_ids=after)
    if text_format.json_schema is None:
        raise APIError.bad_request("text.format of type json_schema needs a schema", "text")
    spec = json.dumps(text_format.json_schema)
    return StructuredOutputs(kind="json", spec=spec, after_token_ids=after)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, raw_request: Request):
    state: ServerState = raw_request.app.state.baton
    arrival = time.monotonic()
    with named_as_responses():
        chat = to_chat_request(body)
        prompt, params, plan = await prepare_chat(state, chat)
    structured = _text_format(body, plan, reasoning_end_ids(state.tokenizer, plan.settings))
    if structured is not None:  # the same check (and lowering) as chat's response_format
        params = dataclasses.replace(params, structured_outputs=structured)
        params = await checked_structured(params, "text.format")
    check_disagg(state, chat.baton_disagg)
    admit(state)
    response_id = new_id("resp")
    requests = fan_out(response_id, [prompt], params, 1, chat.baton_disagg)
    shell = _response_shell(state, body, chat, response_id)
    parser = plan.parser()
    if body.stream:
        events = response_events(
            state, shell, plan, OutputStream(parser), prompt, requests, arrival
        )
        return StreamingResponse(events, media_type="text/event-stream")
    (result,) = await collect(state, requests, arrival, raw_request)
    parsed = parser.parse(result.text, text_end(True, result.finish_reason))
    call_ids = [new_id("call") for _ in parsed.calls]
    output = _items(parsed, call_ids, plan.max_calls)
    return finished_response(shell, output, prompt, result)


def _response_shell(state: ServerState, body: ResponsesRequest, chat, response_id: str) -> dict:
    """The response object's fields that do not depend on the answer (OpenAI's echo of the
    request)."""
    text_format = body.text.format if body.text is not None and body.text.format else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": answered_model(state, body.model),
        "status": "in_progress",
        "output": [],
        "instructions": body.instructions,
        "tools": [tool.model_dump() for tool in body.tools or []],
        "tool_choice": body.tool_choice.model_dump()
        if hasattr(body.tool_choice, "model_dump")
        else body.tool_choice or "auto",
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        # the sampling in effect, as OpenAI and vLLM echo it
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "background": False,
        "service_tier": "auto",
        "max_output_tokens": body.max_output_tokens,
        "previous_response_id": None,
        "reasoning": body.reasoning.model_dump() if body.reasoning else None,
        "text": {
            "format": text_format.model_dump(by_alias=True) if text_format else {"type": "text"}
        },
        "metadata": body.metadata or {},
        "store": False,
        "truncation": "disabled",
        "user": body.user,
        "error": None,
        "incomplete_details": None,
        "usage": None,
    }


def _items(parsed: ParsedOutput, call_ids: list[str], max_calls: int | None) -> list[dict]:
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning))
    if parsed.content:
        items.append(message_item(new_id("msg"), parsed.content, "completed"))
    for call, call_id in list(zip(parsed.calls, call_ids, strict=True))[:max_calls]:
        items.append(call_item(new_id("fc"), call_id, call.name, call.arguments, "completed"))
    return items
