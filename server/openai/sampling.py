"""From an OpenAI request to SamplingParams and validated prompts (HTTP 400 on anything wrong)."""

from __future__ import annotations

import dataclasses

from baton.engine.core.sampling_params import SamplingParams
from baton.server.errors import APIError
from baton.server.openai.protocol import GenerationFields
from baton.server.openai.structured import structured_outputs_of

# Request fields copied to SamplingParams as they are when the client sets them.
_PASS_THROUGH = (
    "temperature",
    "top_p",
    "min_p",
    "seed",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "skip_special_tokens",
    "include_stop_str_in_output",
)


def build_sampling_params(
    request: GenerationFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """vocab_size None (the router, which has no model) checks everything but the vocabulary
    (and the structured-output spec itself: server/openai/structured.py's checked_structured)."""
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    stop_token_ids = list(request.stop_token_ids or [])
    for token_id in stop_token_ids:
        check_token_id(token_id, vocab_size, "stop_token_ids")
    kwargs = {
        name: getattr(request, name) for name in _PASS_THROUGH if getattr(request, name) is not None
    }
    if request.logit_bias:
        kwargs["logit_bias"] = logit_bias(request.logit_bias, vocab_size)
    if request.top_k is not None:
        # A top-k at least the vocabulary size keeps every token: the same as no top-k.
        keeps_all = vocab_size is not None and request.top_k >= vocab_size
        kwargs["top_k"] = -1 if keeps_all else request.top_k
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            stop=[text for text in stop if text],  # an empty stop string would match everywhere
            stop_token_ids=stop_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            structured_outputs=structured_outputs_of(request),
            **kwargs,
        )
    except ValueError as error:  # its messages start with the parameter's name
        name = str(error).split(" ", 1)[0].rstrip(":")
        raise APIError.bad_request(str(error), name if hasattr(request, name) else None) from error


def logit_bias(given: dict[str, float], vocab_size: int | None) -> dict[int, float]:
    """OpenAI's logit_bias: token ids as decimal strings -> a bias in [-100, 100]."""
    bias = {}
    for key, value in given.items():
        if not key.isascii() or not key.isdigit():
            raise APIError.bad_request(
                f"logit_bias: key {key!r} is not a token id (a decimal integer)", "logit_bias"
            )
        check_token_id(int(key), vocab_size, "logit_bias")
        bias[int(key)] = float(value)
    return bias


def check_token_id(token_id: int, vocab_size: int | None, param: str) -> None:
    if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
        bounds = f"[0, {vocab_size})" if vocab_size is not None else "(ids are >= 0)"
        raise APIError.bad_request(
            f"{param}: token id {token_id} is outside the vocabulary {bounds}", param
        )


def check_prompt(
    prompt_token_ids: list[int],
    max_tokens: int,
    *,
    vocab_size: int,
    max_model_len: int,
    param: str,
    fit_to_context: bool = True,
) -> int:
    """Refuse an empty prompt, unknown token ids and a prompt that leaves no room to generate;
    returns the max_tokens the engine runs. `fit_to_context` (the OpenAI routes, as vLLM):
    prompt + max_tokens over the context gets what the context leaves (finish_reason "length"),
    and only a max_tokens over the whole context is refused. Without it (SGLang's /generate,
    as SGLang) prompt + max_tokens must fit."""
    if not prompt_token_ids:
        raise APIError.bad_request(f"{param} must not be empty", param)
    # Length first: a prompt of millions of tokens is refused before anything walks it.
    prompt_len = len(prompt_token_ids)
    if prompt_len + max_tokens > max_model_len:
        if not fit_to_context:
            raise APIError.bad_request(
                f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = "
                f"{prompt_len + max_tokens} tokens exceeds max-model-len ({max_model_len})",
                "max_tokens",
            )
        if prompt_len >= max_model_len:
            raise APIError.bad_request(
                f"{param}: the prompt ({prompt_len} tokens) with at least 1 token to generate "
                f"exceeds max-model-len ({max_model_len})",
                param,
            )
        if max_tokens > max_model_len:
            raise APIError.bad_request(
                f"max_tokens ({max_tokens}) exceeds max-model-len ({max_model_len})", "max_tokens"
            )
        max_tokens = max_model_len - prompt_len
    check_token_ids(prompt_token_ids, vocab_size, param)
    return max_tokens


def truncate_prompt(
    prompt_token_ids: list[int],
    keep: int | None,
    side: str | None,
    max_model_len: int,
) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens ("left", the default) or the first
    ("right"); -1 keeps as many as the context holds with one token left to generate."""
    if keep is None:
        return prompt_token_ids
    if keep == -1:
        keep = max_model_len - 1
    if not 1 <= keep <= max_model_len:
        raise APIError.bad_request(
            f"truncate_prompt_tokens must be -1 or in [1, max-model-len {max_model_len}], "
            f"got {keep}",
            "truncate_prompt_tokens",
        )
    return prompt_token_ids[:keep] if side == "right" else prompt_token_ids[-keep:]


def params_for_prompt(
    params: SamplingParams,
    prompt_token_ids: list[int],
    max_tokens: int,
    *,
    vocab_size: int,
    max_model_len: int,
    param: str,
    fit_to_context: bool = True,
) -> SamplingParams:
    """`params` for one prompt: check_prompt's rules, then max_tokens cut to what the context
    leaves (refused when that is below min_tokens)."""
    fitted = check_prompt(
        prompt_token_ids,
        max_tokens,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        param=param,
        fit_to_context=fit_to_context,
    )
    if fitted == params.max_tokens:
        return params
    if params.min_tokens > fitted:
        raise APIError.bad_request(
            f"min_tokens ({params.min_tokens}) is more than the {fitted} tokens the "
            "context leaves after the prompt",
            "min_tokens",
        )
    return dataclasses.replace(params, max_tokens=fitted)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """min/max run in C: millions of ids are checked without a Python loop on the event loop."""
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        for token_id in token_ids:
            check_token_id(token_id, vocab_size, param)
