"""Depthwise causal conv1d (+ SiLU, or no activation) with pool conv states, Triton path (semantics:
kernels/conv1d.py).

Varlen prefill runs three launches that follow the torch path's padded rows without building
them: each packed token's input column is `layout.token_column[t]` in row s = column // width,
and column j of that row holds conv state column j (j < K-1) or packed token row_source[...].

    1. _conv_varlen_kernel   y[t] = act(bias + sum_i w[:, i] * input(column(t) - (K-1) + i))
    2. _conv_window_kernel   windows for checkpoints: the K-1 inputs ending at given columns
    3. _conv_window_kernel   again, ending at each sequence's last token, into the pool slots

Launch 1 and 2 only read the pool; launch 3 writes it, after every read of the old states is
done (launches on one stream run in order). Inside launch 3 and in the decode update a program
reads and rewrites one slot, so it loads the whole old window, passes a CTA barrier, then stores:
a store never overtakes another thread's read of the same slot. No autotune anywhere.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.layouts import ConvActivation, ConvLayout


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


# fmt: off
@triton.jit
def _conv_varlen_kernel(
    x_ptr, w_ptr, bias_ptr, conv_ptr, slots_ptr, token_column_ptr, row_source_ptr, y_ptr,
    stride_x_t, stride_x_d, stride_w_d, stride_w_k,
    stride_conv_s, stride_conv_d, stride_conv_k, stride_y_t, stride_y_d,
    num_tokens, dim, width,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # fmt: on
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok, d_ok = t < num_tokens, d < dim
    column = tl.load(token_column_ptr + t, mask=t_ok, other=0).to(tl.int64)
    seq = column // width
    slot = tl.load(slots_ptr + seq, mask=t_ok, other=0).to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    for i in tl.static_range(K):
        flat = column - (K - 1) + i
        col = flat - seq * width  # column inside the row: < K-1 means the initial conv state
        in_state = t_ok & (col < K - 1)
        in_tokens = t_ok & (col >= K - 1)
        src = tl.load(row_source_ptr + flat, mask=in_tokens, other=0)
        from_x = tl.load(
            x_ptr + src[:, None] * stride_x_t + d[None, :] * stride_x_d,
            mask=in_tokens[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)
        from_state = tl.load(
            conv_ptr + slot[:, None] * stride_conv_s + d[None, :] * stride_conv_d
            + col[:, None] * stride_conv_k,
            mask=in_state[:, None] & d_ok[None, :], other=0.0,
        ).to(tl.float32)
        w = tl.load(w_ptr + d * stride_w_d + i * stride_w_k, mask=d_ok, other=0.0).to(tl.float32)
        acc += (from_x + from_state) * w[None, :]
    if SILU:
        acc = _silu(acc)
    tl.store(
        y_ptr + t[:, None] * stride_y_t + d[None, :] * stride_y_d,
        acc.to(y_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :],
    )


# fmt: off
@triton.jit
def _conv_window_kernel(
    x_ptr, conv_ptr, slots_ptr, row_source_ptr, end_column_ptr, dst_ptr, dst_index_ptr,
    stride_x_t, stride_x_d, stride_conv_s, stride_conv_d, stride_conv_k,
    stride_end, stride_dst_s, stride_dst_d, stride_dst_k,
    dim, width,
    K: tl.constexpr, BLOCK_KM1: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # fmt: on
    row = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, BLOCK_KM1)
    d_ok, i_ok = d < dim, i < K - 1
    end = tl.load(end_column_ptr + row * stride_end).to(tl.int64)  # column of the last input
    seq = end // width
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    flat = end - (K - 2) + i
    col = flat - seq * width
    in_state = i_ok & (col < K - 1)
    in_tokens = i_ok & (col >= K - 1)
    src = tl.load(row_source_ptr + flat, mask=in_tokens, other=0)
    from_x = tl.load(
        x_ptr + src[None, :] * stride_x_t + d[:, None] * stride_x_d,
        mask=d_ok[:, None] & in_tokens[None, :], other=0.0,
    ).to(tl.float32)
    from_state = tl.load(
        conv_ptr + slot * stride_conv_s + d[:, None] * stride_conv_d + col[None, :] * stride_conv_k,
        mask=d_ok[:, None] & in_state[None, :], other=0.0,
    ).to(tl.float32)
    window = (from_x + from_state).to(dst_ptr.dtype.element_ty)  # exact: values are copies
    dst_row = tl.load(dst_index_ptr + row).to(tl.int64)
    tl.debug_barrier()  # dst may be the slot just read (a short sequence keeps old state columns)
    tl.store(
        dst_ptr + dst_row * stride_dst_s + d[:, None] * stride_dst_d + i[None, :] * stride_dst_k,
        window, mask=d_ok[:, None] & i_ok[None, :],
    )


# fmt: off
@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, conv_ptr, slots_ptr, y_ptr,
    stride_x_b, stride_x_d, stride_w_d, stride_w_k,
    stride_conv_s, stride_conv_d, stride_conv_k, stride_y_b, stride_y_d,
    dim,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_KM1: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # fmt: on
    b = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.arange(0, BLOCK_KM1)
    d_ok, i_ok = d < dim, i < K - 1
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state_at = conv_ptr + slot * stride_conv_s + d[:, None] * stride_conv_d
    old = tl.load(
        state_at + i[None, :] * stride_conv_k, mask=d_ok[:, None] & i_ok[None, :], other=0.0
    )
    shifted = tl.load(  # old columns 1..K-2; the new input goes in column K-2
        state_at + (i[None, :] + 1) * stride_conv_k,
        mask=d_ok[:, None] & (i[None, :] + 1 < K - 1), other=0.0,
    )
    x_raw = tl.load(x_ptr + b * stride_x_b + d * stride_x_d, mask=d_ok, other=0.0)
    w_state = tl.load(
        w_ptr + d[:, None] * stride_w_d + i[None, :] * stride_w_k,
        mask=d_ok[:, None] & i_ok[None, :], other=0.0,
    ).to(tl.float32)
    w_new = tl.load(w_ptr + d * stride_w_d + (K - 1) * stride_w_k, mask=d_ok, other=0.0)
    acc = tl.sum(old.to(tl.float32) * w_state, axis=1) + x_raw.to(tl.float32) * w_new.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    new_state = tl.where(
        i[None, :] == K - 2, x_raw.to(tl.float32)[:, None], shifted.to(tl.float32)
    ).to(conv_ptr.dtype.element_ty)
    tl.debug_barrier()  # every thread has read the old window before any thread rewrites it
    tl.store(
        state_at + i[None, :] * stride_conv_k, new_state, mask=d_ok[:, None] & i_ok[None, :]
    )
    if SILU:
        acc = _silu(acc)
    tl.store(y_ptr + b * stride_y_b + d * stride_y_d, acc.to(y_ptr.dtype.element_ty), mask=d_ok)


def _block_d(dim: int) -> tuple[int, int]:
    """Channel block and warps: >= 32 lanes of work per warp so no element is replicated."""
    block_d = min(256, max(32, triton.next_power_of_2(dim)))
    return block_d, max(1, min(4, block_d // 64))


def _check_common(x, weight, bias, conv_states, state_indices, rows: int) -> int:
    dim, K = weight.shape
    if K < 2:
        raise ValueError(f"conv kernel width must be >= 2, got {K}")
    if x.shape[-1] != dim:
        raise ValueError(f"x has {x.shape[-1]} channels, weight (dim, K) has {dim}")
    if conv_states.dim() != 3 or conv_states.shape[1:] != (dim, K - 1):
        raise ValueError(f"conv_states must be (num_slots, {dim}, {K - 1}), "
                         f"got {tuple(conv_states.shape)}")
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"bias must be ({dim},), got {tuple(bias.shape)}")
    if state_indices.shape != (rows,):
        raise ValueError(f"state_indices must be ({rows},), got {tuple(state_indices.shape)}")
    tensors = [x, weight, conv_states, state_indices] + ([bias] if bias is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError("causal conv1d: all tensors must share one device")
    return K


def causal_conv1d_varlen_triton(
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

    x: (num_tokens, dim) float32/float16/bfloat16, any strides; weight: (dim, K); bias: (dim,)
    or None; conv_states: (num_slots, dim, K-1) pool (any float dtype), read at and written to
    state_indices: (num_seqs,) int; layout: ConvLayout (row_source, token_column,
    final_columns, width); window_tokens: optional (M,) int64 packed token indices.
    Returns y (num_tokens, dim) in x's dtype and windows (M, dim, K-1) in x's dtype (the conv
    state right after each window token) or None.
    """
    num_tokens, dim = x.shape
    S, W = layout.num_seqs, layout.width
    K = _check_common(x, weight, bias, conv_states, state_indices, S)
    if layout.token_column.shape != (num_tokens,) or layout.final_columns.shape != (S, K - 1):
        raise ValueError("layout does not match x / weight: token_column must be (num_tokens,) "
                         "and final_columns (num_seqs, K-1)")
    y = torch.empty(num_tokens, dim, device=x.device, dtype=x.dtype)
    if num_tokens == 0 or S == 0:
        empty = None if window_tokens is None else x.new_empty(0, dim, K - 1)
        return y, empty
    BLOCK_D, warps = _block_d(dim)
    BLOCK_T = 16
    # <= 8 outputs per thread: at Nano's 12288 channels 16 x 256 tiles on 8 warps use 158
    # registers (4 warps spill on sm_90).
    varlen_warps = max(1, min(8, BLOCK_T * BLOCK_D // 512))
    BLOCK_KM1 = triton.next_power_of_2(K - 1)
    # fmt: off
    _conv_varlen_kernel[(triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(dim, BLOCK_D))](
        x, weight, bias if bias is not None else weight, conv_states, state_indices,
        layout.token_column, layout.row_source, y,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        *conv_states.stride(), y.stride(0), y.stride(1),
        num_tokens, dim, W,
        K=K, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_T=BLOCK_T,
        BLOCK_D=BLOCK_D, num_warps=varlen_warps,
    )
    # fmt: on

    def gather_windows(end_columns: torch.Tensor, dst: torch.Tensor, dst_index: torch.Tensor):
        # fmt: off
        _conv_window_kernel[(end_columns.shape[0], triton.cdiv(dim, BLOCK_D))](
            x, conv_states, state_indices, layout.row_source, end_columns, dst, dst_index,
            x.stride(0), x.stride(1), *conv_states.stride(),
            end_columns.stride(0), *dst.stride(),
            dim, W,
            K=K, BLOCK_KM1=BLOCK_KM1, BLOCK_D=BLOCK_D, num_warps=warps,
        )
        # fmt: on

    windows = None
    if window_tokens is not None:
        M = window_tokens.shape[0]
        windows = x.new_empty(M, dim, K - 1)
        if M:
            ends = layout.token_column[window_tokens]
            gather_windows(ends, windows, torch.arange(M, device=x.device))
    # Last: overwrite the pool slots (every read of the old states above is done by now).
    gather_windows(layout.final_columns[:, K - 2], conv_states, state_indices)
    return y, windows


def causal_conv1d_update_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: ConvActivation = "silu",
) -> torch.Tensor:
    """One decode step. x: (batch, dim) float32/float16/bfloat16; weight: (dim, K); bias: (dim,)
    or None; conv_states: (num_slots, dim, K-1) pool updated in place at state_indices (batch,)
    (padded rows point at dummy slot 0). Returns activation(conv): (batch, dim) in x's dtype."""
    batch, dim = x.shape
    K = _check_common(x, weight, bias, conv_states, state_indices, batch)
    y = torch.empty(batch, dim, device=x.device, dtype=x.dtype)
    if batch == 0:
        return y
    BLOCK_D, warps = _block_d(dim)
    # fmt: off
    _conv_update_kernel[(batch, triton.cdiv(dim, BLOCK_D))](
        x, weight, bias if bias is not None else weight, conv_states, state_indices, y,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        *conv_states.stride(), y.stride(0), y.stride(1),
        dim,
        K=K, HAS_BIAS=bias is not None, SILU=activation == "silu",
        BLOCK_KM1=triton.next_power_of_2(K - 1), BLOCK_D=BLOCK_D, num_warps=warps,
    )
    # fmt: on
    return y
