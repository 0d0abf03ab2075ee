"""Engine logprobs (token_id -> logprob per generated token) in the two OpenAI shapes.

completions: {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}], "text_offset"}
chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{...}]}]}
"""

from __future__ import annotations

import math

from baton.engine.core.outputs import TokenLogprobs
from baton.server.tokenizer import Tokenizer

_FLOOR = -9999.0  # JSON has no -inf; a token the sampler ruled out gets this instead


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _FLOOR


def _ranked(entry: TokenLogprobs) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: (-item[1], item[0]))


def completion_logprobs(
    tokenizer: Tokenizer,
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    text_offset: int,
) -> dict:
    """Logprobs of consecutive tokens whose text starts at character `text_offset`; an entry
    None (an echoed prompt's first token, which nothing predicts) is null in both lists."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
        else:
            token_logprobs.append(_finite(entry[token_id]))
            top_logprobs.append(
                {tokenizer.token_text(alt): _finite(lp) for alt, lp in _ranked(entry)}
            )
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _chat_token(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict:
    return {
        "token": tokenizer.token_text(token_id),
        "logprob": _finite(logprob),
        "bytes": list(tokenizer.token_bytes(token_id)),
    }


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], logprobs: list[TokenLogprobs], top_logprobs: int
) -> list[dict]:
    """The `logprobs.content` entries of consecutive tokens, each with its `top_logprobs` best."""
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        item = _chat_token(tokenizer, token_id, entry[token_id])
        item["top_logprobs"] = [
            _chat_token(tokenizer, alt, lp) for alt, lp in _ranked(entry)[:top_logprobs]
        ]
        content.append(item)
    return content
