"""Sliding-window attention over the paged KV cache: query at absolute position p attends to the
keys at positions p - window + 1 .. p (transformers' `kv_idx > q_idx - sliding_window` on top of
the causal mask), read through the one attention layout every attention layer shares
(kernels/layouts.py; built by engine/executor/forward_metadata.py, which knows nothing of windows).

    decode (one query a sequence)  the layout is narrowed to each sequence's last
                                   min(kv_len, window) keys: the same decode kernels then run
                                   (C on the CPU, Triton on the GPU, the torch path elsewhere),
                                   reading no slot behind the window
    extend / verify (q > 1)        every query has its own window start: on the CPU the C
                                   extend kernel reads each query's window from the pages;
                                   elsewhere the keys from the first query's window start on (at
                                   most max_q + window - 1 of them) are gathered once and one
                                   masked SDPA runs (torch path)

Slots behind the window are never read, so their pages may have been released and point at the
dummy page 0 (engine/core/scheduler_memory.py releases them during decode).

Shapes: q (num_tokens, heads, head_dim); k_cache, v_cache (num_token_slots, kv_heads, head_dim);
layout.kv_indices (num_seqs, max_kv) int64 token slots, kv_lens (num_seqs,) int32 tokens after
this step's writes, query_start_loc (num_seqs + 1,) int32. Returns like q.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels.attention import paged_attention
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.layouts import AttentionLayout


def window_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: AttentionLayout,
    scale: float,
    window: int,
) -> torch.Tensor:
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if layout.max_q == 1 and q.shape[0] == layout.num_seqs:
        return paged_attention(q, k_cache, v_cache, decode_window_layout(layout, window), scale)
    if cpu_ops.decode_attention_supported(q, k_cache):
        # each query's window straight from the pages (kernels/cpu/ops.c): no gathered keys,
        # no (S, Q, Q + window) mask; 2.6x the masked SDPA on an LFM3 prefill step (one thread)
        return cpu_ops.extend_attention_cpu(
            q, k_cache, v_cache, layout.kv_indices, layout.kv_lens, layout.query_start_loc,
            scale, window,
        )  # fmt: skip
    return window_attention_masked(q, k_cache, v_cache, layout, scale, window)


def decode_window_layout(layout: AttentionLayout, window: int) -> AttentionLayout:
    """One query a sequence: its keys narrowed to the last min(kv_len, window), as a layout any
    decode kernel reads (width min(max_kv, window); derived on the device, no host sync, so a
    captured decode step derives it too)."""
    max_kv = layout.max_kv
    width = min(max_kv, window)
    kv_lens = layout.kv_lens.clamp(max=window)
    start = (layout.kv_lens - kv_lens).to(torch.int64)
    columns = torch.arange(width, device=start.device)
    index = (start[:, None] + columns[None, :]).clamp(max=max(max_kv - 1, 0))
    kv_indices = torch.gather(layout.kv_indices[:, :max_kv], 1, index) if width else index
    mask = columns[None, :] < kv_lens[:, None]
    if width:
        mask[:, 0] = True  # padding rows (kv_len 0) must not be all -inf
    return layout._replace(
        max_kv=width,
        kv_lens=kv_lens,
        kv_indices=kv_indices,
        mask=mask[:, None, None, :],
    )


def window_attention_masked(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    layout: AttentionLayout,
    scale: float,
    window: int,
) -> torch.Tensor:
    """Queries of several tokens a sequence (extend, verify): query i of sequence s sits at
    kv_len - q_len + i. The keys gathered start at the first query's window start; the mask
    keeps, for each query, the causal keys within its window."""
    num_tokens, H, Dh = q.shape
    S, Q, max_kv = layout.num_seqs, layout.max_q, layout.max_kv
    device = q.device
    q_lens = (layout.query_start_loc[1:] - layout.query_start_loc[:-1]).to(torch.int64)
    kv_lens = layout.kv_lens.to(torch.int64)
    first_q = kv_lens - q_lens  # absolute position of each sequence's first query
    lo = (first_q - window + 1).clamp(min=0)
    width = min(max_kv, Q + window - 1)
    key_pos = lo[:, None] + torch.arange(width, device=device)[None, :]  # (S, width)
    slots = torch.gather(layout.kv_indices[:, :max_kv], 1, key_pos.clamp(max=max_kv - 1))
    q_pos = first_q[:, None] + torch.arange(Q, device=device)[None, :]  # (S, Q)
    kp, qp_ = key_pos[:, None, :], q_pos[:, :, None]
    mask = (kp <= qp_) & (kp > qp_ - window) & (kp < kv_lens[:, None, None])
    # padding query rows (i >= q_len) may see nothing: give them one key, their output is dropped
    mask[:, :, 0] |= ~mask.any(dim=-1)
    qp = torch.cat([q, q.new_zeros(1, H, Dh)])[layout.slot_q].view(S, Q, H, Dh).transpose(1, 2)
    flat = slots.reshape(-1)
    k = k_cache.index_select(0, flat).view(S, width, *k_cache.shape[1:]).to(q.dtype)
    v = v_cache.index_select(0, flat).view(S, width, *v_cache.shape[1:]).to(q.dtype)
    out = F.scaled_dot_product_attention(
        qp,
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask[:, None],
        scale=scale,
        enable_gqa=H != k.shape[2],
    )  # (S, H, Q, Dh)
    return out.transpose(1, 2).reshape(S * Q, H, Dh)[layout.q_slot]
