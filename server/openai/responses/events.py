"""The streamed form of a /v1/responses answer: OpenAI's events, numbered by sequence_number.

    response.created, response.in_progress
    per item: response.output_item.added
              reasoning: response.reasoning_text.delta ... .done
              message:   response.content_part.added, response.output_text.delta ... .done,
                         response.content_part.done
              call:      response.function_call_arguments.delta ... .done
              response.output_item.done
    response.completed (its response's status "incomplete" when max_output_tokens cut it)

Items open in the order their first text arrives and all close at the end, in order.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator

from baton.server.engine_client import EngineRejected, EngineUnavailable, RequestFailedServerSide
from baton.server.openai.generation import ChoiceResult, ServerState, timed_deltas
from baton.server.parsers.blocks import text_end
from baton.server.parsers.output import OutputStream


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "type": "message",
        "id": item_id,
        "role": "assistant",
        "status": status,
        "content": [part] if status == "completed" else [],
    }


def reasoning_item(item_id: str, text: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def finished_response(
    shell: dict, output: list[dict], prompt: list[int], result: ChoiceResult
) -> dict:
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


async def response_events(
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
                parsed = stream.update(result.text, text_end(delta.finished, delta.finish_reason))
                if parsed.reasoning:
                    if reasoning_at is None:
                        reasoning_at, added = writer.open(reasoning_item(new_id("rs"), ""))
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
                            message_item(new_id("msg"), "", "in_progress")
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
                        call_ids.append(new_id("call"))
                        item = call_item(
                            new_id("fc"), call_ids[-1], call["function"]["name"], "", "in_progress"
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
        "response.completed", response=finished_response(shell, writer.output, prompt, result)
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
            item = reasoning_item(item["id"], text)
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
            item = message_item(item_id, text, "completed")
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
