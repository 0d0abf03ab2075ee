"""A multi-turn chat workload: conversations that extend their own earlier turns, interleaved.

Each conversation starts with a system prompt shared by all (as an application's is) and a
first user message of its own; every next turn's prompt is the previous prompt, the answer the
server gave to it (its token ids, as a chat client keeps the history) and a new user message.
Conversations run side by side, up to `concurrency` turns in flight, each one's turns in order,
so turns of different conversations interleave at the server:

    conversation 0:  [sys|u0] -> a0      [sys|u0|a0|u1] -> a1      [sys|u0|a0|u1|a1|u2] -> ...
    conversation 1:       [sys|v0] -> b0      [sys|v0|b0|v1] -> b1      ...

Prompts are token ids drawn with a seed (lengths exact, so two seeds give the same prefix-cache
geometry: hit counts compare across runs on different seeds) and answers have a fixed length
(`ignore_eos`). A turn's TTFT is measured from sending it to its first streamed token.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True, kw_only=True)
class MultiTurnWorkload:
    conversations: int
    turns: int
    system_len: int  # tokens of the system prompt every conversation starts with
    first_len: int  # tokens of a conversation's first user message
    turn_len: int  # tokens of each later user message
    output_len: int  # tokens of each answer
    seed: int
    vocab_size: int  # ids are drawn from [FIRST_ID, vocab_size)


FIRST_ID = 3  # below: <pad>, <s>, </s> in baton's tokenizers


@dataclass(frozen=True, kw_only=True)
class TurnResult:
    conversation: int
    turn: int
    prompt_len: int
    ttft_s: float
    e2e_s: float
    token_ids: list[int]
    text: str


def user_messages(workload: MultiTurnWorkload) -> list[list[list[int]]]:
    """Per conversation, per turn, the tokens the user adds (the first turn: system + message)."""
    rng = random.Random(workload.seed)

    def draw(n: int) -> list[int]:
        return [rng.randrange(FIRST_ID, workload.vocab_size) for _ in range(n)]

    system = draw(workload.system_len)
    return [
        [system + draw(workload.first_len)]
        + [draw(workload.turn_len) for _ in range(workload.turns - 1)]
        for _ in range(workload.conversations)
    ]


async def _turn(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int
) -> tuple[float, list[int], str]:
    """(TTFT, answer ids, answer text) of one streamed completion."""
    body = {
        **({"model": model} if model else {}),
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    start = time.perf_counter()
    ttft, ids, text = None, [], []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"answered {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data:") :])
            if "error" in chunk:
                raise RuntimeError(f"stream failed: {chunk['error']}")
            for choice in chunk["choices"]:
                if choice.get("token_ids") and ttft is None:
                    ttft = time.perf_counter() - start
                ids += choice.get("token_ids") or []
                text.append(choice.get("text") or "")
    if ttft is None:
        raise RuntimeError("the stream carried no token")
    return ttft, ids, "".join(text)


async def run_multi_turn(
    base_url: str,
    workload: MultiTurnWorkload,
    *,
    concurrency: int,
    model: str = "",
    api_key: str | None = None,
) -> list[TurnResult]:
    """Every turn of every conversation, in the order they finished."""
    messages = user_messages(workload)
    results: list[TurnResult] = []
    slots = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def conversation(index: int, client: httpx.AsyncClient) -> None:
        history: list[int] = []
        for turn, added in enumerate(messages[index]):
            prompt = history + added
            async with slots:
                start = time.perf_counter()
                ttft, ids, text = await _turn(client, model, prompt, workload.output_len)
                e2e = time.perf_counter() - start
            results.append(
                TurnResult(
                    conversation=index,
                    turn=turn,
                    prompt_len=len(prompt),
                    ttft_s=ttft,
                    e2e_s=e2e,
                    token_ids=ids,
                    text=text,
                )
            )
            history = prompt + ids

    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=httpx.Timeout(300, connect=10)
    ) as client:
        await asyncio.gather(*(conversation(i, client) for i in range(workload.conversations)))
    return results


def answers(results: list[TurnResult]) -> dict[tuple[int, int], list[int]]:
    """(conversation, turn) -> answer ids: what must not depend on the routing policy."""
    return {(r.conversation, r.turn): r.token_ids for r in results}
