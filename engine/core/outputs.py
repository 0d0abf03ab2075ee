"""What the engine hands back: per-step deltas for streaming and whole outputs for `LLM`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

FinishReason = Literal["stop", "length", "abort"]

# One entry per token: token_id -> logprob, always including the token itself.
TokenLogprobs = dict[int, float]


class SampledTokens(NamedTuple):
    """What one step sampled for one request: one token, or with speculation the accepted
    drafts followed by the token sampled after them (the scheduler appends them in order and
    stops at the first that ends the request)."""

    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs | None, ...]  # one per token, None when none were asked for


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestDelta:
    """What one engine step produced for one request (streaming unit).

    The engine leaves `new_text` empty and ends requests by token id only (EOS,
    stop_token_ids, length); the detokenizer stage (engine/core/detokenizer.py, in the server process
    or the offline LLM) fills `new_text` (incomplete UTF-8 held back, stop strings removed;
    concatenating every delta's text gives the final text) and ends requests at stop strings.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[TokenLogprobs | None] | None  # only on the first delta
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None  # the stop string or stop token id that ended it
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(kw_only=True, slots=True)
class RequestOutput:
    """The whole result of one request (one sample when n > 1)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    logprobs: list[TokenLogprobs] | None
    prompt_logprobs: list[TokenLogprobs | None] | None
    num_cached_tokens: int
