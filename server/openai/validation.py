"""The request rules that need no model, shared by the workers and the router.

A worker applies them before it tokenizes anything; the router applies the very same functions
before it dispatches anything, so a request that either worker would refuse for its JSON, its
types or its sampling parameters never starts a prefill (the two halves see different bodies:
the prefill half has `stream` off and no `stream_options`). Rules that need the model (the
served name, token ids within the vocabulary, prompt + max_tokens within the context, the chat
template) are applied by both workers alike to the same prompt, so the prefill worker refuses
such a request before it opens a room.

    raw body ──parse_json_body──> dict ──parse_generation──> CompletionRequest | ChatCompletionRequest
                                                  └──check_generation (sampling parameters, n, …)
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import ValidationError

from baton.server.errors import APIError, describe_validation_errors
from baton.server.openai.protocol import (
    MAX_JSON_DEPTH,
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    SGLangSamplingParams,
    TokenizeRequest,
    nests_deeper_than,
    unencodable_text,
)
from baton.server.openai.responses.protocol import (
    ResponsesRequest,
    named_as_responses,
    to_chat_request,
)
from baton.server.openai.sampling import build_sampling_params
from baton.server.openai.tool_choice import check_tools

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for completions

GENERATION_MODELS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/generate": GenerateRequest,  # SGLang's native route
    "/v1/responses": ResponsesRequest,  # checked as the chat request it amounts to
}


def _body_error(message: str) -> APIError:
    return APIError(400, message)  # about the body as a whole: no parameter to name


class _NotFinite(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    raise _NotFinite(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text)
    return value


def parse_json_body(raw: bytes) -> dict:
    """A JSON object, strictly: NaN, Infinity and numbers that overflow a double (1e400) are refused, and so
    are nesting deeper than MAX_JSON_DEPTH and text that is not valid Unicode (a lone surrogate)
    in any field (APIError 400 for each)."""
    try:
        value = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NotFinite as error:
        where = _path_to_non_finite(raw)
        raise APIError(
            400,
            f"{where or 'request body'}: {error} is not a finite JSON number",
            where.split(".")[0] if where else None,
        ) from None
    except RecursionError:
        raise _body_error(
            f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels"
        ) from None
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError, int digit limits
        raise _body_error(f"request body is not valid JSON: {error}") from None
    if not isinstance(value, dict):  # every body this API takes is an object
        raise _body_error("request body must be a JSON object")
    _check_depth(value)
    if (bad := unencodable_text(value)) is not None:
        path, reason = bad
        raise APIError(400, f"{path}: {reason}", path.split(".")[0])
    return value


def _path_to_non_finite(raw: bytes) -> str | None:
    """Where the first NaN / infinity sits ("temperature", "messages.0.x"), for the message;
    only runs on the error path, so the lenient second parse costs a valid request nothing."""
    try:
        stack: list[tuple[str, Any]] = [("", json.loads(raw))]
    except (ValueError, RecursionError):
        return None
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or None
        items = (
            value.items()
            if isinstance(value, dict)
            else enumerate(value)
            if isinstance(value, list)
            else ()
        )
        stack.extend(
            (f"{path}.{key}" if path else str(key), child) for key, child in reversed(list(items))
        )
    return None


def _check_depth(value: Any) -> None:
    if nests_deeper_than(value, MAX_JSON_DEPTH):
        raise _body_error(f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels")


def parse_generation(path: str, body: Any) -> CompletionRequest | ChatCompletionRequest:
    """The request model for `path`, with the worker's messages (400) for a body it refuses;
    SGLang's /generate comes back as the completions request it amounts to."""
    if not isinstance(body, dict):
        raise _body_error("request body must be a JSON object")
    try:
        request = GENERATION_MODELS[path].model_validate(body)
    except ValidationError as error:
        message, param = describe_validation_errors(error.errors())
        raise APIError(400, message, param) from None
    if isinstance(request, GenerateRequest):
        return completion_from_generate(request)
    if isinstance(request, ResponsesRequest):
        with named_as_responses():
            chat = to_chat_request(request)
            check_generation(chat)
        return chat
    check_generation(request)
    return request


# SGLang sampling_params -> the completions field it is (the rest have the same name).
_SGLANG_RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
# SGLang's constrained decoding -> vLLM's structured_outputs key (server/openai/structured.py)
_SGLANG_STRUCTURED = {
    "json_schema": "json",
    "regex": "regex",
    "ebnf": "grammar",
    "structural_tag": "structural_tag",
}


def completion_from_generate(request: GenerateRequest) -> CompletionRequest:
    """SGLang's /generate as a completions request, checked by the same rules (400 naming the
    SGLang field where only it applies); return_logprob becomes `logprobs` (top_logprobs_num
    alternatives), and the prompt's logprobs (logprob_start_len >= 0) are asked for by the
    /generate handler itself."""
    if (request.text is None) == (request.input_ids is None):
        raise APIError.bad_request("give exactly one of text and input_ids", "text")
    for name in ("lora_path", "image_data"):
        if getattr(request, name) is not None:
            raise APIError.bad_request(f"{name} is not supported by this server", name)
    sampling = request.sampling_params or SGLangSamplingParams()
    if isinstance(sampling, list):
        prompts = request.text if request.text is not None else request.input_ids
        count = num_prompts(prompts)
        if len(sampling) != count or any(other != sampling[0] for other in sampling):
            raise APIError.bad_request(
                f"sampling_params: a list must hold one set per prompt ({count}), all the same "
                "(a batch runs with one set here); send prompts that differ as separate requests",
                "sampling_params",
            )
        sampling = sampling[0]
    fields = {
        _SGLANG_RENAMED.get(name, name): value
        for name, value in sampling.model_dump(exclude=set(_SGLANG_STRUCTURED)).items()
    }
    constraints = {
        key: getattr(sampling, name)
        for name, key in _SGLANG_STRUCTURED.items()
        if getattr(sampling, name) is not None
    }
    if constraints:
        fields["structured_outputs"] = constraints  # more than one: refused as vLLM's would be
    fields["prompt"] = request.text if request.text is not None else request.input_ids
    fields["stream"] = request.stream
    if request.return_logprob:
        fields["logprobs"] = request.top_logprobs_num
    if request.baton_disagg is not None:
        fields["baton_disagg"] = request.baton_disagg.model_dump()
    try:
        completion = CompletionRequest.model_validate(fields)
    except ValidationError as error:
        message, param = describe_validation_errors(error.errors())
        raise APIError(400, message, param) from None
    if completion.max_tokens == 0:
        raise APIError.bad_request("max_new_tokens must be at least 1", "sampling_params")
    check_generation(completion)
    return completion


def num_prompts(prompt: str | list) -> int:
    """How many prompts a completions `prompt` holds: text and a token-id list are one each."""
    if isinstance(prompt, str) or (prompt and all(isinstance(item, int) for item in prompt)):
        return 1
    return len(prompt)


def num_logprobs(request: ChatCompletionRequest) -> int | None:
    if not request.logprobs:
        if request.top_logprobs:
            raise APIError.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        return None
    return request.top_logprobs or 0


def requested_max_tokens(request: CompletionRequest | ChatCompletionRequest) -> int | None:
    """What the client asked for; None (chat only) means whatever the context leaves."""
    if isinstance(request, CompletionRequest):
        return DEFAULT_MAX_TOKENS if request.max_tokens is None else request.max_tokens
    if request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


# Fields baton parses only to refuse: each with the values that ask for nothing (OpenAI's and
# vLLM's defaults), which are accepted. Anything else would be silently not done.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),  # OpenAI's deprecated form of tools
    "function_call": (None, "none"),
    "prompt_logprobs": (None,),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "logits_processors": (None, []),
    "suffix": (None, ""),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1.0, 1),  # only beam search reads it
    "logprob_token_ids": (None, []),
    "prompt_embeds": (None,),
    "return_tokens_as_token_ids": (None, False),
    "return_token_offsets": (None, False),
    "thinking_token_budget": (None,),
    "repetition_detection": (None,),
    "vllm_xargs": (None, {}),
}
# Chat's tools, which completions (as vLLM's) does not take
COMPLETION_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),  # auto with no tools is none
}
# vLLM's chat-only ones (completions' `echo` is done)
CHAT_UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "chat_template": (None,),  # vLLM refuses it too unless started --trust-request-chat-template
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
    "media_io_kwargs": (None, {}),
}


def check_unsupported(request: CompletionRequest | ChatCompletionRequest) -> None:
    extra = (
        CHAT_UNSUPPORTED_FIELDS
        if isinstance(request, ChatCompletionRequest)
        else COMPLETION_UNSUPPORTED_FIELDS
    )
    refused = {**UNSUPPORTED_FIELDS, **extra}
    for name, neutral in refused.items():
        value = getattr(request, name, None)
        if not any(value == allowed and type(value) is type(allowed) for allowed in neutral):
            raise APIError.bad_request(f"{name} is not supported by this server", name)
    best_of = getattr(request, "best_of", None)
    if best_of is not None and (type(best_of) is not int or best_of != request.n):
        raise APIError.bad_request(
            f"best_of is not supported (only best_of = n, here {request.n}), got {best_of!r}",
            "best_of",
        )


def engine_max_tokens(
    request: CompletionRequest | ChatCompletionRequest, requested: int | None
) -> int:
    """What the engine is asked for: echo's max_tokens 0 (score the prompt) runs one token that
    the answer leaves out; an unset chat max_tokens is checked here as its smallest value."""
    if requested is None:
        return max(1, request.min_tokens)
    if requested == 0 and isinstance(request, CompletionRequest) and request.echo:
        return 1
    return requested


def check_continue_final_message(request: ChatCompletionRequest | TokenizeRequest) -> None:
    if request.continue_final_message and request.add_generation_prompt:
        raise APIError.bad_request(
            "continue_final_message and add_generation_prompt cannot both be true (the prompt "
            "either opens a new assistant message or continues the last one)",
            "continue_final_message",
        )


def check_generation(request: CompletionRequest | ChatCompletionRequest) -> None:
    """Every rule on a generation request that needs no model or tokenizer (APIError 400)."""
    check_unsupported(request)
    if isinstance(request, CompletionRequest):
        if request.max_tokens == 0 and not request.echo:
            raise APIError.bad_request(
                "max_tokens must be at least 1 (0 only with echo, to score a prompt)", "max_tokens"
            )
        prompts = num_prompts(request.prompt)
        if prompts == 0:
            raise APIError.bad_request("prompt must not be empty", "prompt")
        if prompts * request.n > MAX_N:
            raise APIError.bad_request(
                f"n ({request.n}) x {prompts} prompts must be at most {MAX_N} choices", "n"
            )
        logprobs = request.logprobs
    else:
        check_continue_final_message(request)
        check_tools(request)
        logprobs = num_logprobs(request)
    # Unset chat max_tokens depends on the prompt's length; min_tokens is checked against it
    # by the worker once the prompt is tokenized.
    max_tokens = requested_max_tokens(request)
    build_sampling_params(
        request,
        max_tokens=engine_max_tokens(request, max_tokens),
        logprobs=logprobs,
        vocab_size=None,
    )
