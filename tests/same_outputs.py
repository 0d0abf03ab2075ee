"""One comparison for every cache-hit test: the same tokens and, for each, the same logprob.

Tokens alone do not catch a stale Mamba state on a tiny model that barely reacts to it (with the
seed bug put back, tokens stayed equal while logprobs moved by 0.02); in fp32 a resumed state and
a recomputed one agree to ~1e-6.
"""

from __future__ import annotations

from baton.engine.core.outputs import RequestOutput, TokenLogprobs

LOGPROB_TOLERANCE = 1e-4


def assert_same_tokens_and_logprobs(
    got_tokens: list[int],
    got_logprobs: list[float],
    expected_tokens: list[int],
    expected_logprobs: list[float],
    where: str,
) -> None:
    assert got_tokens == expected_tokens, f"{where}: tokens differ"
    assert len(got_logprobs) == len(expected_logprobs) == len(expected_tokens), where
    worst = max((abs(a - b) for a, b in zip(got_logprobs, expected_logprobs)), default=0.0)
    assert worst <= LOGPROB_TOLERANCE, f"{where}: logprobs differ by {worst:.3g}"


def chosen(token_ids: list[int], logprobs: list[TokenLogprobs]) -> list[float]:
    """The logprob of each sampled token (the entries also hold the top alternatives)."""
    return [entry[token] for token, entry in zip(token_ids, logprobs, strict=True)]


def assert_same_outputs(got: list[RequestOutput], expected: list[RequestOutput]) -> None:
    assert len(got) == len(expected)
    for i, (mine, theirs) in enumerate(zip(got, expected)):
        assert mine.logprobs is not None and theirs.logprobs is not None, "ask for logprobs"
        assert_same_tokens_and_logprobs(
            mine.token_ids,
            chosen(mine.token_ids, mine.logprobs),
            theirs.token_ids,
            chosen(theirs.token_ids, theirs.logprobs),
            f"request {i}",
        )
