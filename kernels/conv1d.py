"""Depthwise causal conv1d over a packed varlen batch with per-sequence conv state, torch path.
Its outputs go through SiLU (Mamba's conv) or no activation (LFM2's short conv): `activation`.

A conv state holds the last K-1 inputs of a sequence (K = kernel width), the window that the next
token's convolution needs. Pool layout: conv_states (num_slots, dim, K-1); slot 0 is the dummy
slot that padded rows read and write.

The varlen torch path builds one padded input per sequence, [state (K-1) | tokens | pad], so a
single grouped F.conv1d serves the whole batch:

    row s:  [ s0 s1 s2 | x0 x1 x2 ... x_{n-1} | 0 ... ]     (K = 4)
              initial       tokens of seq s
    window ending at token j = columns j+1 .. j+K-1  (what a checkpoint at j+1 stores)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.cpu import prefill as cpu_prefill
from baton.kernels.layouts import ConvActivation, ConvLayout


def build_window_layout(
    seq_lens: list[int], kernel_width: int, device: torch.device | str
) -> ConvLayout:
    num_seqs, km1 = len(seq_lens), kernel_width - 1
    max_len = max(seq_lens, default=0)
    width = km1 + max_len
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    num_tokens = int(lens.sum())
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens)
    starts = torch.cumsum(lens, 0) - lens
    local = torch.arange(num_tokens) - starts[seq_of_token]
    token_column = seq_of_token * width + km1 + local
    zero_row = num_tokens + num_seqs * km1
    row_source = torch.full((num_seqs * width,), zero_row, dtype=torch.int64)
    row_source[token_column] = torch.arange(num_tokens)
    state_columns = (torch.arange(num_seqs)[:, None] * width + torch.arange(km1)).flatten()
    row_source[state_columns] = num_tokens + torch.arange(num_seqs * km1)
    final_columns = torch.arange(num_seqs)[:, None] * width + lens[:, None] + torch.arange(km1)
    return ConvLayout(
        num_seqs=num_seqs,
        width=width,
        row_source=row_source.to(device),
        token_column=token_column.to(device),
        final_columns=final_columns.to(device),
    )


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    layout: ConvLayout,
    window_tokens: torch.Tensor | None = None,
    activation: ConvActivation = "silu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal conv + `activation` of packed sequences, continuing from and updating pool states.

    x: (num_tokens, dim); weight: (dim, K); bias: (dim,) or None;
    conv_states: (num_slots, dim, K-1) pool, read at and written to `state_indices` (num_seqs,);
    window_tokens: optional (M,) int64 packed token indices; returns the conv state as it stands
    right after each of those tokens, (M, dim, K-1), for checkpoints.
    Returns (out (num_tokens, dim) in x's dtype, windows or None).
    """
    if select_backend(x) == "triton":
        from baton.kernels.triton.conv1d import causal_conv1d_varlen_triton

        return causal_conv1d_varlen_triton(
            x, weight, bias, conv_states, state_indices, layout, window_tokens, activation
        )
    if cpu_prefill.conv_supported(x, conv_states, weight.shape[1]):
        return cpu_prefill.causal_conv1d_varlen_cpu(
            x, weight, bias, conv_states, state_indices, layout, window_tokens, activation
        )
    return causal_conv1d_varlen_torch(
        x, weight, bias, conv_states, state_indices, layout, window_tokens, activation
    )


def causal_conv1d_varlen_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    layout: ConvLayout,
    window_tokens: torch.Tensor | None = None,
    activation: ConvActivation = "silu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    dim, K = weight.shape
    S, W = layout.num_seqs, layout.width
    init = conv_states[state_indices].to(x.dtype).transpose(1, 2).reshape(-1, dim)
    source = torch.cat([x, init, x.new_zeros(1, dim)])
    flat = source[layout.row_source]  # (S * W, dim)
    rows = flat.view(S, W, dim).transpose(1, 2)  # (S, dim, W)
    out = F.conv1d(rows, weight.to(x.dtype).unsqueeze(1), bias, groups=dim)  # (S, dim, W-K+1)
    if activation == "silu":
        out = F.silu(out)
    out = out.transpose(1, 2).reshape(-1, dim)
    # out row s column j is the output of the token at input column j + K-1.
    out_index = layout.token_column - (K - 1) * (layout.token_column // W + 1)
    y = out[out_index]
    final = flat[layout.final_columns]  # (S, K-1, dim)
    conv_states[state_indices] = final.transpose(1, 2).to(conv_states.dtype)
    windows = None
    if window_tokens is not None:
        ends = layout.token_column[window_tokens]  # flat column of the token itself
        cols = ends[:, None] - (K - 2) + torch.arange(K - 1, device=x.device)
        windows = flat[cols].transpose(1, 2).contiguous()  # (M, dim, K-1)
    return y, windows


def causal_conv1d_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: ConvActivation = "silu",
) -> torch.Tensor:
    """One decode step. x: (batch, dim); conv_states: (num_slots, dim, K-1) pool updated at
    `state_indices` (batch,) (padded rows point at dummy slot 0). Returns activation(conv):
    (batch, dim)."""
    if select_backend(x) == "triton":
        from baton.kernels.triton.conv1d import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, weight, bias, conv_states, state_indices, activation)
    if cpu_ops.conv_update_supported(conv_states, x, weight.shape[1]):
        return cpu_ops.causal_conv1d_update_cpu(
            x, weight, bias, conv_states, state_indices, activation
        )
    return causal_conv1d_update_torch(x, weight, bias, conv_states, state_indices, activation)


def causal_conv1d_update_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: ConvActivation = "silu",
) -> torch.Tensor:
    window = torch.cat([conv_states[state_indices].to(x.dtype), x.unsqueeze(-1)], dim=-1)
    out = (window * weight.to(x.dtype)).sum(-1)
    if bias is not None:
        out = out + bias
    conv_states[state_indices] = window[..., 1:].to(conv_states.dtype)
    return F.silu(out) if activation == "silu" else out


def causal_conv1d_update_multi(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """q decode steps per request (speculative verify), keeping the window after each one.

    x: (batch, q, dim); conv_states: (num_slots, dim, K-1) pool; state_indices: (batch, q + 1)
    int64: column 0 is the window read, column i + 1 receives the window after token i (padded
    rows: dummy slot 0 throughout). Returns silu(conv): (batch, q, dim) in x's dtype. Pure
    tensor ops with no host sync, so the same path runs on the GPU and inside a CUDA graph."""
    batch, q, dim = x.shape
    K = weight.shape[1]
    # [window (K-1) | q tokens] per request: output i reads columns i .. i + K - 1.
    rows = torch.cat([conv_states[state_indices[:, 0]].to(x.dtype), x.transpose(1, 2)], dim=-1)
    out = F.conv1d(rows, weight.to(x.dtype).unsqueeze(1), bias, groups=dim)  # (batch, dim, q)
    # the window after token i: columns i + 1 .. i + K - 1
    windows = rows.unfold(-1, K - 1, 1)[:, :, 1 : q + 1]  # (batch, dim, q, K-1)
    conv_states[state_indices[:, 1:].reshape(-1)] = (
        windows.permute(0, 2, 1, 3).reshape(batch * q, dim, K - 1).to(conv_states.dtype)
    )
    return F.silu(out).transpose(1, 2)
