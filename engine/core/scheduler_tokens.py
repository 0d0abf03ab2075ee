"""How sampled tokens join a request: appended in order, each checked against what ends it
(its grammar, EOS, a stop token, max_tokens, the context), and the delta a step reports.

Only the scheduler (engine/core/scheduler.py) calls these: it owns every request's state.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from baton.engine.core.outputs import FinishReason, RequestDelta, SampledTokens, TokenLogprobs
from baton.engine.core.request import Request


class OutputConstraint(Protocol):
    """What constrains generated tokens beyond the sampler (structured outputs'
    engine/structured_output/grammars.py): told of every token appended, it may end the request
    ("stop": its grammar is complete; "abort": it cannot go on)."""

    def accept(self, req: Request, token: int) -> FinishReason | None: ...

    def forget(self, request_id: str) -> None: ...


class Appended(NamedTuple):
    token_ids: list[int]  # appended this step (the sampled ones up to the first that ended it)
    logprobs: list[TokenLogprobs]  # theirs, when the request asked for logprobs
    finish: FinishReason | None
    stop_reason: str | int | None  # the stop token id that ended it


def append_tokens(
    req: Request,
    sampled: SampledTokens,
    constraint: OutputConstraint | None,
    eos_token_ids: tuple[int, ...],
    max_model_len: int,
) -> Appended:
    """Append tokens in order until one ends the request; the rest are dropped (speculation
    may sample past a stop)."""
    params = req.params
    finish, stop_reason, tokens, token_logprobs = None, None, [], []
    for token, logprobs in zip(sampled.token_ids, sampled.logprobs):
        req.output_ids.append(token)
        tokens.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
            token_logprobs.append(logprobs)
        past_min = len(req.output_ids) > params.min_tokens
        constrained = constraint.accept(req, token) if constraint is not None else None
        if constrained is not None:
            finish = constrained  # its grammar ended ("stop") or cannot go on ("abort")
        elif not params.ignore_eos and token in eos_token_ids and past_min:
            finish = "stop"
        elif token in params.stop_token_ids and past_min:
            finish, stop_reason = "stop", token
        if finish is None and (
            len(req.output_ids) >= params.max_tokens or req.num_tokens >= max_model_len
        ):
            finish = "length"
        if finish is not None:
            break
    return Appended(tokens, token_logprobs, finish, stop_reason)


def delta_of(req: Request, appended: Appended) -> RequestDelta:
    """The delta a step reports for `req` (its prompt logprobs ride on its first token's)."""
    first = len(req.output_ids) == len(appended.token_ids)
    return RequestDelta(
        request_id=req.request_id,
        new_token_ids=appended.token_ids,
        new_text="",  # filled by the detokenizer stage
        new_logprobs=appended.logprobs or None,
        prompt_logprobs=req.prompt_logprobs
        if first and req.params.prompt_logprobs is not None
        else None,
        finished=appended.finish is not None,
        finish_reason=appended.finish,
        stop_reason=appended.stop_reason,
        num_prompt_tokens=len(req.prompt_ids),
        num_cached_tokens=req.num_cached_tokens,
    )
