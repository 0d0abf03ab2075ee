"""Kimi Delta Attention, Triton path (semantics: kernels/kda.py; the shared recurrence scheme:
kernels/triton/recurrences.py): per (sequence or row, head, block of value columns), the (dk,
BLOCK_V) state tile in registers, the delta rule with a per-channel decay token by token."""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.layouts import ChunkLayout
from baton.kernels.triton.recurrences import (
    head_tile,
    scan_outputs,
    slot_tiles,
    store_chunk_ends,
    store_state,
    store_tail_chunks,
    v_block,
)

L2NORM_EPS = 1e-6  # kernels/kda.py's (transformers' and FLA's l2norm eps)


# fmt: off
@triton.jit
def _kda_token(state, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, h, dk_i, dv_j, k_ok, v_ok,
               stride_qk_t, stride_qk_h, stride_v_t, stride_v_h, stride_b_t, scale, eps, live):
    # fmt: on
    """One token of the delta rule with a per-channel decay on the (dk, BLOCK_V) tile; returns
    (o, the new tile). `live` False: the tile passes unchanged and o is 0."""
    at_qk = t * stride_qk_t + h * stride_qk_h + dk_i
    q = tl.load(q_ptr + at_qk, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + at_qk, mask=k_ok, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + at_qk, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_v_t + h * stride_v_h + dv_j, mask=v_ok, other=0.0)
    beta = tl.load(beta_ptr + t * stride_b_t + h).to(tl.float32)
    q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + eps))
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + eps)
    g = tl.where(live, g, 0.0)
    beta = tl.where(live, beta, 0.0)
    state = state * tl.exp(g)[:, None]
    kv = tl.sum(k[:, None] * state, axis=0)
    state = state + k[:, None] * ((v.to(tl.float32) - kv) * beta)[None, :]
    o = tl.where(live, tl.sum(q[:, None] * state, axis=0), 0.0)
    return o, state


# fmt: off
@triton.jit
def _kda_scan_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, cu_ptr, start_ptr, o_ptr,
    chunk_ptr,
    stride_qk_t, stride_qk_h, stride_v_t, stride_v_h, stride_b_t, stride_o_t, stride_o_h,
    stride_state_s, stride_chunk_s, stride_chunk_c,
    H, dk, dv, num_chunks, L, scale, eps,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # fmt: on
    s = tl.program_id(0)
    h, dk_i, dv_j, k_ok, v_ok, tile = head_tile(dk, dv, BLOCK_K, BLOCK_V)
    tile_ok = k_ok[:, None] & v_ok[None, :]
    t0 = tl.load(cu_ptr + s).to(tl.int64)
    count = tl.load(cu_ptr + s + 1).to(tl.int64) - t0
    offset = tl.load(start_ptr + s).to(tl.int64) % L
    slot = tl.load(slots_ptr + s).to(tl.int64)
    state = tl.load(state_ptr + slot * stride_state_s + tile, mask=tile_ok, other=0.0).to(
        tl.float32
    )
    chunk_at = chunk_ptr + s * stride_chunk_s + tile
    for j in range(0, count):
        t = t0 + j
        # fmt: off
        o, state = _kda_token(state, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, t, h, dk_i, dv_j,
                              k_ok, v_ok, stride_qk_t, stride_qk_h, stride_v_t, stride_v_h,
                              stride_b_t, scale, eps, count >= 0)
        # fmt: on
        tl.store(o_ptr + t * stride_o_t + h * stride_o_h + dv_j, o, mask=v_ok)
        store_chunk_ends(chunk_at, stride_chunk_c, state, tile_ok, offset, j, L)
    store_tail_chunks(chunk_at, stride_chunk_c, state, tile_ok, offset, count, L, num_chunks)
    store_state(state_ptr, slot, stride_state_s, tile, state, tile_ok)


# fmt: off
@triton.jit
def _kda_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, o_ptr,
    stride_qk_t, stride_qk_h, stride_v_t, stride_v_h, stride_b_t, stride_o_t, stride_o_h,
    stride_state_s, dk, dv, scale, eps,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # fmt: on
    b = tl.program_id(0).to(tl.int64)
    h, dk_i, dv_j, k_ok, v_ok, tile = head_tile(dk, dv, BLOCK_K, BLOCK_V)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    live = slot != 0
    tile_ok = k_ok[:, None] & v_ok[None, :] & ((dk_i * 0 + slot) != 0)[:, None]
    state = tl.load(state_ptr + slot * stride_state_s + tile, mask=tile_ok, other=0.0).to(
        tl.float32
    )
    # fmt: off
    o, state = _kda_token(state, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, b, h, dk_i, dv_j, k_ok,
                          v_ok, stride_qk_t, stride_qk_h, stride_v_t, stride_v_h, stride_b_t,
                          scale, eps, live)
    # fmt: on
    tl.store(o_ptr + b * stride_o_t + h * stride_o_h + dv_j, o, mask=v_ok)
    store_state(state_ptr, slot, stride_state_s, tile, state, tile_ok)



def _qk_like(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor):
    """q, k and g with one shared (token, head) stride pair and unit channel stride."""
    q, k, g = q.contiguous(), k.contiguous(), g.float().contiguous()
    return q, k, g



def kda_prefill_triton(q, k, v, g, beta, state_pool, state_indices, layout: ChunkLayout):
    """kernels/kda.py's kda_prefill (arguments checked there): (o, chunk_states)."""
    slot_tiles(state_pool, "kda_prefill")
    q, k, g = _qk_like(q, k, g)
    v, beta = v.contiguous(), beta.float().contiguous()
    T, H, dk = q.shape
    dv = v.shape[-1]
    S, Cn = layout.num_seqs, layout.num_chunks
    o, chunks = scan_outputs(q, v, v.dtype, layout)
    if T == 0 or S == 0:
        return o, chunks
    BLOCK_K, BLOCK_V = v_block(dk, dv)
    # fmt: off
    _kda_scan_kernel[(S, H, triton.cdiv(dv, BLOCK_V))](
        q, k, v, g, beta, state_pool, state_indices, layout.cu_seqlens, layout.start_pos, o,
        chunks,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), beta.stride(0), o.stride(0),
        o.stride(1), state_pool.stride(0), chunks.stride(0), chunks.stride(1),
        H, dk, dv, Cn, layout.chunk_size, dk**-0.5, L2NORM_EPS,
        BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=4,
    )
    # fmt: on
    return o, chunks


def kda_decode_triton(q, k, v, g, beta, state_pool, state_indices) -> torch.Tensor:
    """kernels/kda.py's kda_decode (arguments checked there)."""
    slot_tiles(state_pool, "kda_decode")
    q, k, g = _qk_like(q, k, g)
    v, beta = v.contiguous(), beta.float().contiguous()
    batch, H, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty(batch, H, dv, device=v.device, dtype=v.dtype)
    if batch == 0:
        return o
    BLOCK_K, BLOCK_V = v_block(dk, dv)
    # fmt: off
    _kda_decode_kernel[(batch, H, triton.cdiv(dv, BLOCK_V))](
        q, k, v, g, beta, state_pool, state_indices, o,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), beta.stride(0), o.stride(0),
        o.stride(1), state_pool.stride(0), dk, dv, dk**-0.5, L2NORM_EPS,
        BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=4,
    )
    # fmt: on
    return o
