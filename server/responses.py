"""POST /v1/responses: OpenAI's Responses API over the chat pipeline (responses_protocol.py
turns the request into a chat request; the answer is read by the same parsers).

An answer is a list of output items, in this order: a `reasoning` item (with a reasoning
parser), a `message` with one output_text part (when there is text), a `function_call` per
tool call. Streamed, the events are OpenAI's, each with a growing sequence_number:

    response.created, response.in_progress
    per item: response.output_item.added
              reasoning: response.reasoning_text.delta ... .done
              message:   response.content_part.added, response.output_text.delta ... .done,
                         response.content_part.done
              call:      response.function_call_arguments.delta ... .done
              response.output_item.done
    response.completed (its response's status "incomplete" when max_output_tokens cut it)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.sampling_params import StructuredOutputs
from server.chat import prepare_chat
from server.engine_client import EngineRejected, EngineUnavailable, RequestFailedServerSide
from server.errors import APIError
from server.generation import (
    ChoiceResult,
    ServerState,
    admit,
    check_disagg,
    collect,
    fan_out,
    timed_deltas,
)
from server.output_parser import OutputStream, ParsedOutput
from server.responses_protocol import ResponsesRequest, to_chat_request
from server.tool_choice import reasoning_end_ids

router = APIRouter()


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


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
    chat = to_chat_request(body)
    prompt, params, plan = await prepare_chat(state, chat)
    structured = _text_format(body, plan, reasoning_end_ids(state.tokenizer, plan.settings))
    if structured is not None:
        params = dataclasses.replace(params, structured_outputs=structured)
    check_disagg(state, chat.baton_disagg)
    admit(state)
    response_id = _id("resp")
    requests = fan_out(response_id, [prompt], params, 1, chat.baton_disagg)
    shell = _response_shell(state, body, chat, response_id)
    parser = plan.parser()
    if body.stream:
        events = _events(state, shell, plan, OutputStream(parser), prompt, requests, arrival)
        return StreamingResponse(events, media_type="text/event-stream")
    (result,) = await collect(state, requests, arrival, raw_request)
    parsed = parser.parse(result.text, final=True)
    call_ids = [_id("call") for _ in parsed.calls]
    output = _items(parsed, call_ids, plan.max_calls)
    return _finished(shell, output, prompt, result)


def _response_shell(state: ServerState, body: ResponsesRequest, chat, response_id: str) -> dict:
    """The response object's fields that do not depend on the answer (OpenAI's echo of the
    request)."""
    text_format = body.text.format if body.text is not None and body.text.format else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "model": state.args.model_name,
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


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [part] if status == "completed" else [],
    }


def _reasoning_item(item_id: str, text: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _items(parsed: ParsedOutput, call_ids: list[str], max_calls: int | None) -> list[dict]:
    items = []
    if parsed.reasoning:
        items.append(_reasoning_item(_id("rs"), parsed.reasoning))
    if parsed.content:
        items.append(_message_item(_id("msg"), parsed.content, "completed"))
    for call, call_id in list(zip(parsed.calls, call_ids, strict=True))[:max_calls]:
        items.append(_call_item(_id("fc"), call_id, call.name, call.arguments, "completed"))
    return items


def _finished(shell: dict, output: list[dict], prompt: list[int], result: ChoiceResult) -> dict:
    cut = result.finish_reason == "length"
    return {
        **shell,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": output,
        "usage": {
            "input_tokens": len(prompt),
            "input_tokens_details": {"cached_tokens": result.num_cached_tokens},
            "output_tokens": len(result.token_ids),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(prompt) + len(result.token_ids),
        },
    }


class _EventWriter:
    """Numbers events and keeps the open items (index in `output`, kind, text so far)."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict] = []
        self.texts: list[str] = []

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def open(self, item: dict) -> tuple[int, str]:
        self.output.append(item)
        self.texts.append("")
        index = len(self.output) - 1
        return index, self.event("response.output_item.added", output_index=index, item=item)


async def _events(
    state: ServerState, shell: dict, plan, stream: OutputStream, prompt, requests, arrival
) -> AsyncIterator[str]:
    writer = _EventWriter()
    yield writer.event("response.created", response=shell)
    yield writer.event("response.in_progress", response=shell)
    result = ChoiceResult()
    reasoning_at = message_at = None
    calls_at: list[int] = []
    call_ids: list[str] = []
    try:
        async with contextlib.aclosing(timed_deltas(state, requests, arrival)) as deltas:
            async for _, delta in deltas:
                result.add(delta)
                parsed = stream.update(result.text, delta.finished)
                if parsed.reasoning:
                    if reasoning_at is None:
                        reasoning_at, added = writer.open(_reasoning_item(_id("rs"), ""))
                        yield added
                    writer.texts[reasoning_at] += parsed.reasoning
                    yield writer.event(
                        "response.reasoning_text.delta",
                        item_id=writer.output[reasoning_at]["id"],
                        output_index=reasoning_at,
                        content_index=0,
                        delta=parsed.reasoning,
                    )
                if parsed.content:
                    if message_at is None:
                        message_at, added = writer.open(
                            _message_item(_id("msg"), "", "in_progress")
                        )
                        yield added
                        yield writer.event(
                            "response.content_part.added",
                            item_id=writer.output[message_at]["id"],
                            output_index=message_at,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    writer.texts[message_at] += parsed.content
                    yield writer.event(
                        "response.output_text.delta",
                        item_id=writer.output[message_at]["id"],
                        output_index=message_at,
                        content_index=0,
                        delta=parsed.content,
                        logprobs=[],
                    )
                for call in parsed.tool_calls:
                    if call["index"] >= (plan.max_calls or 1 << 30):
                        continue
                    if "id" in call:
                        call_ids.append(_id("call"))
                        item = _call_item(
                            _id("fc"), call_ids[-1], call["function"]["name"], "", "in_progress"
                        )
                        at, added = writer.open(item)
                        calls_at.append(at)
                        yield added
                    at = calls_at[call["index"]]
                    fragment = call["function"]["arguments"]
                    if fragment:
                        writer.texts[at] += fragment
                        yield writer.event(
                            "response.function_call_arguments.delta",
                            item_id=writer.output[at]["id"],
                            output_index=at,
                            delta=fragment,
                        )
    except (EngineRejected, RequestFailedServerSide, EngineUnavailable) as error:
        code = 400 if isinstance(error, EngineRejected) else 503
        yield writer.event("error", code=str(code), message=str(error), param=None)
        return
    for event in _close_items(writer):
        yield event
    # Also for a max_output_tokens cut (status "incomplete" inside), as vLLM ends it: the
    # official client's stream helper wants response.completed to hand over the response.
    yield writer.event(
        "response.completed", response=_finished(shell, writer.output, prompt, result)
    )


def _close_items(writer: _EventWriter):
    """The .done events of every item, in order, and the items' final form in `output`."""
    for index, item in enumerate(writer.output):
        text = writer.texts[index]
        if item["type"] == "reasoning":
            yield writer.event(
                "response.reasoning_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=text,
            )
            item = _reasoning_item(item["id"], text)
        elif item["type"] == "message":
            item_id = item["id"]
            part = {"type": "output_text", "text": text, "annotations": []}
            yield writer.event(
                "response.output_text.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            )
            yield writer.event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            )
            item = _message_item(item_id, text, "completed")
        else:
            yield writer.event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                arguments=text,
            )
            item = {**item, "arguments": text, "status": "completed"}
        writer.output[index] = item
        yield writer.event("response.output_item.done", output_index=index, item=item)
