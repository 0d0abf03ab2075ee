"""What a request's state looks like when it leaves one engine and enters another.

The prefill engine snapshots a finished prefill (K/V pages, final conv + SSM state, first token)
before its pages and slot are freed; the decode engine preallocates pages and a slot, then
installs the snapshot and continues decoding as if it had run the prefill itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.core.outputs import TokenLogprobs


@dataclass(frozen=True, kw_only=True, slots=True)
class RequestState:
    """A prefill's state from page `first_page` and prefix-cache block `first_block` on (the
    decode engine already holds what comes before: its own cached prefix)."""

    num_prompt_tokens: int
    first_token: int
    first_logprobs: TokenLogprobs | None
    first_page: int
    first_block: int
    k_pages: torch.Tensor  # (attention_layers, num_pages, page_size, kv_heads, head_dim)
    v_pages: torch.Tensor  # same
    conv: torch.Tensor  # (mamba_layers, conv_dim, K-1) final conv window
    ssm: torch.Tensor  # (mamba_layers, heads, head_dim, d_state) final SSM state
    checkpoint_conv: torch.Tensor  # (num_blocks, mamba_layers, conv_dim, K-1) at block ends
    checkpoint_ssm: torch.Tensor  # (num_blocks, mamba_layers, heads, head_dim, d_state)

    def skip(self, pages: int, blocks: int) -> RequestState:
        """The part a decode engine that caches `pages` pages / `blocks` blocks still needs."""
        return dataclasses.replace(
            self,
            first_page=self.first_page + pages,
            first_block=self.first_block + blocks,
            k_pages=self.k_pages[:, pages:],
            v_pages=self.v_pages[:, pages:],
            checkpoint_conv=self.checkpoint_conv[blocks:],
            checkpoint_ssm=self.checkpoint_ssm[blocks:],
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Preallocation:
    pages: tuple[int, ...]  # decode-side pages the prompt's K/V go to
    mamba_slot: int
    num_prompt_tokens: int
    cached_tokens: int  # prompt tokens this engine already caches (their pages need no transfer)


@dataclass(frozen=True, kw_only=True, slots=True)
class HandoverLayout:
    """What a disaggregation worker needs to know of its engine's pools (the same for every
    request): the facts both sides of a handover must share, and the sizes its messages are cut
    by."""

    model_fingerprint: str  # of the model config
    weights_fingerprint: str  # of the checkpoint's tensors (engine/checkpoint/fingerprint.py)
    dtype: str  # model dtype (K/V pages, conv state)
    page_size: int
    attention_layers: int
    kv_page_shape: tuple[int, ...]  # one layer's page: (page_size, kv_heads, head_dim)
    kv_page_bytes: int  # one page of K and V over every attention layer
    mamba_layers: int
    conv_shape: tuple[int, ...]  # one layer's conv window: (conv_dim, K-1)
    ssm_shape: tuple[int, ...]  # one layer's SSM state: (heads, head_dim, d_state)
    ssm_dtype: str
    mamba_layer_bytes: int  # conv window + SSM state of one layer
    # The shapes above are this rank's slices; these are the whole model's (what two engines of
    # different TP sizes must share), and this engine's TP size.
    model_kv_page_shape: tuple[int, ...]
    model_conv_shape: tuple[int, ...]
    model_ssm_shape: tuple[int, ...]
    tp_size: int
