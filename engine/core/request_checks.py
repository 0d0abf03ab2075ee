"""What a request must satisfy before the engine takes it: tokens in the vocabulary, sampling
parameters in range, and prompt + max_tokens within the context. ValueError names what is wrong
(the server answers it with a 400); nothing is created."""

from __future__ import annotations

from baton.engine.core.sampling_params import SamplingParams


def check_request(
    prompt_token_ids: list[int], params: SamplingParams, vocab_size: int, max_model_len: int
) -> None:
    if not prompt_token_ids:
        raise ValueError("prompt must contain at least one token")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    params.validate()
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("logit_bias", params.logit_bias),
    ):
        outside = [t for t in ids if t >= vocab_size]
        if outside:  # the sampler indexes the logits with them
            raise ValueError(
                f"{name}: token id {outside[0]} is outside the vocabulary [0, {vocab_size})"
            )
    total = len(prompt_token_ids) + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the maximum context length of {max_model_len} tokens"
        )
