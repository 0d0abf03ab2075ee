"""What a request's state looks like when it leaves one engine and enters another.

The prefill engine snapshots a finished prefill (K/V pages, final conv + SSM state, first token)
before its pages and slot are freed; the decode engine preallocates pages and a slot, then
installs the snapshot and continues decoding as if it had run the prefill itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprobs


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestState:
    num_prompt_tokens: int
    first_token: int
    first_logprobs: TokenLogprobs | None
    k_pages: torch.Tensor  # (attention_layers, num_pages, page_size, kv_heads, head_dim)
    v_pages: torch.Tensor  # same
    conv: torch.Tensor  # (mamba_layers, conv_dim, K-1)
    ssm: torch.Tensor  # (mamba_layers, heads, head_dim, d_state)


@dataclass(frozen=True, kw_only=True, slots=True)
class Preallocation:
    pages: tuple[int, ...]  # decode-side pages the prompt's K/V go to
    mamba_slot: int
    num_prompt_tokens: int
