"""The prompt's token ids as the workers will see them, for policies that match prefixes.

The router tokenizes with the workers' own code (server/tokenizer.py: the same chat template,
special tokens and truncation), so block boundaries fall where the workers' fall. A batch of
prompts goes to one pair; it is routed by its first prompt.
"""

from __future__ import annotations

from baton.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from baton.server.tokenizer import Tokenizer


def routing_tokens(
    tokenizer: Tokenizer, request: CompletionRequest | ChatCompletionRequest
) -> list[int]:
    """Runs in a worker thread (a long prompt must not hold the event loop); APIError (400) for
    a chat template that refuses the messages, as the worker would answer."""
    if isinstance(request, ChatCompletionRequest):
        tokens = tokenizer.encode_chat(
            request.messages,
            request.add_generation_prompt,
            request.template_variables(),
            request.continue_final_message,
            request.add_special_tokens,
        )
    else:
        prompt = request.prompt
        if not isinstance(prompt, str) and not all(isinstance(item, int) for item in prompt):
            prompt = prompt[0] if prompt else []  # a batch: its first prompt
        if isinstance(prompt, str):
            tokens = tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
        else:
            tokens = list(prompt)
    keep = request.truncate_prompt_tokens
    if keep is not None and keep > 0:  # -1 (the whole context) depends on the worker's length
        tokens = tokens[:keep] if request.truncation_side == "right" else tokens[-keep:]
    return tokens
