"""POST /generate: SGLang's native API, for clients written against an SGLang server
(`sglang.bench_serving --backend sglang`, RL rollout workers that send `input_ids`).

A request is the completions request it amounts to (server/openai/validation.py:
completion_from_generate) and runs the same way; the answer has SGLang's shape: `text`,
`output_ids` and `meta_info` (id, finish_reason as {"type": "length" | "stop" | "abort", ...},
prompt / completion / cached token counts, e2e latency, and with return_logprob SGLang's
[logprob, token id, text] lists) per output, one object for a single
prompt with n = 1, else a list (prompt-major, n outputs each). Streaming sends, per output, its
whole text so far (SGLang's default, not deltas) with an `index`, then `data: [DONE]`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from baton.engine.core.outputs import TokenLogprobs
from baton.server.errors import APIError
from baton.server.openai.completions import start_completion
from baton.server.openai.generation import (
    ChoiceResult,
    ServerState,
    collect,
    sse,
    sse_guard,
    timed_deltas,
)
from baton.server.openai.protocol import GenerateRequest
from baton.server.openai.validation import completion_from_generate, num_prompts
from baton.server.tokenizer import Tokenizer

router = APIRouter()


@router.post("/generate")
async def generate(body: GenerateRequest, raw_request: Request):
    state: ServerState = raw_request.app.state.baton
    arrival = time.monotonic()
    completion = completion_from_generate(body)
    wants_input = body.return_logprob and body.logprob_start_len >= 0
    started = await start_completion(
        state, completion, "gen", prompt_logprobs=wants_input, fit_to_context=False
    )
    shortest = min(len(prompt) for prompt in started.prompts)
    if wants_input and body.logprob_start_len >= shortest:
        raise APIError.bad_request(
            f"logprob_start_len ({body.logprob_start_len}) must be less than the prompt's "
            f"length ({shortest} tokens)",
            "logprob_start_len",
        )
    outputs = Outputs(started.request_id, started.prompts, completion.n, arrival)
    if body.return_logprob:
        outputs.logprobs = Logprobs(state.tokenizer, body)
    if body.stream:
        chunks = _stream(state, outputs, started.requests, arrival)
        return StreamingResponse(sse_guard(chunks), media_type="text/event-stream")
    results = await collect(state, started.requests, arrival, raw_request)
    answers = [outputs.answer(index, result) for index, result in enumerate(results)]
    # one prompt asked with n = 1: its answer alone, as SGLang answers it
    return answers[0] if len(answers) == 1 and num_prompts(completion.prompt) == 1 else answers


class Outputs:
    def __init__(self, request_id: str, prompts: list[list[int]], n: int, arrival: float) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.n = n
        self.arrival = arrival
        self.logprobs: Logprobs | None = None  # with return_logprob

    def answer(self, index: int, result: ChoiceResult) -> dict:
        prompt = self.prompts[index // self.n]
        meta = {
            "id": f"{self.request_id}-{index}",
            "finish_reason": finish_reason(result),
            "prompt_tokens": len(prompt),
            "completion_tokens": len(result.token_ids),
            "cached_tokens": result.num_cached_tokens,
            "e2e_latency": time.monotonic() - self.arrival,
        }
        if self.logprobs is not None:
            meta |= self.logprobs.meta(prompt, result)
        return {"text": result.text, "output_ids": list(result.token_ids), "meta_info": meta}


class Logprobs:
    """SGLang's logprob fields of meta_info: [logprob, token id, text or None] per token, for the
    output and for the prompt from logprob_start_len on (its first token's logprob None), and
    with top_logprobs_num the best alternatives per position."""

    def __init__(self, tokenizer: Tokenizer, body: GenerateRequest) -> None:
        self.tokenizer = tokenizer
        self.start = body.logprob_start_len
        self.top = body.top_logprobs_num
        self.with_text = body.return_text_in_logprobs

    def _entry(self, logprob: float | None, token_id: int) -> list:
        text = self.tokenizer.token_text(token_id) if self.with_text else None
        return [logprob, token_id, text]

    def _tops(self, entries: list[TokenLogprobs | None]) -> list[list | None]:
        return [
            None
            if entry is None
            else [
                self._entry(lp, t)
                for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[: self.top]
            ]
            for entry in entries
        ]

    def meta(self, prompt: list[int], result: ChoiceResult) -> dict:
        meta = {
            "output_token_logprobs": [
                self._entry(entry[token], token)
                for token, entry in zip(result.token_ids, result.logprobs, strict=True)
            ],
            "input_token_logprobs": [],
        }
        if self.top:
            meta["output_top_logprobs"] = self._tops(result.logprobs)
            meta["input_top_logprobs"] = []
        if self.start >= 0 and result.prompt_logprobs is not None:
            entries = result.prompt_logprobs[self.start :]
            ids = prompt[self.start :]
            meta["input_token_logprobs"] = [
                self._entry(None if entry is None else entry[token], token)
                for token, entry in zip(ids, entries, strict=True)
            ]
            if self.top:
                meta["input_top_logprobs"] = self._tops(entries)
        return meta


def finish_reason(result: ChoiceResult) -> dict | None:
    """SGLang's form: length with the count, stop with what matched (a stop string or token id;
    EOS is the last token), abort."""
    if result.finish_reason is None:
        return None
    if result.finish_reason == "length":
        return {"type": "length", "length": len(result.token_ids)}
    if result.finish_reason == "stop":
        matched = result.stop_reason
        if matched is None and result.token_ids:
            matched = result.token_ids[-1]
        return {"type": "stop", "matched": matched}
    return {"type": "abort", "message": result.finish_reason}


async def _stream(
    state: ServerState, outputs: Outputs, requests, arrival: float
) -> AsyncIterator[str]:
    results = [ChoiceResult() for _ in requests]
    async with contextlib.aclosing(timed_deltas(state, requests, arrival)) as deltas:
        async for index, delta in deltas:
            result = results[index]
            result.add(delta)
            if not (delta.new_text or delta.new_token_ids or delta.finished):
                continue
            yield sse({**outputs.answer(index, result), "index": index})
