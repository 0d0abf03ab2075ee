"""Lightning attention, Triton path (semantics: kernels/lightning.py; the shared recurrence
scheme: kernels/triton/recurrences.py): per (sequence or row, head, block of value columns),
S <- g S + k v^T, o = q S, token by token."""

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


# fmt: off
@triton.jit
def _lightning_token(state, q_ptr, k_ptr, v_ptr, t, h, dk_i, dv_j, k_ok, v_ok, stride_t,
                     stride_h, stride_v_t, stride_v_h, ratio):
    # fmt: on
    at = t * stride_t + h * stride_h + dk_i
    q = tl.load(q_ptr + at, mask=k_ok, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + at, mask=k_ok, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + t * stride_v_t + h * stride_v_h + dv_j, mask=v_ok, other=0.0)
    state = ratio * state + k[:, None] * v.to(tl.float32)[None, :]
    return tl.sum(q[:, None] * state, axis=0), state


# fmt: off
@triton.jit
def _lightning_scan_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, state_ptr, slots_ptr, cu_ptr, start_ptr, o_ptr, chunk_ptr,
    stride_t, stride_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h,
    stride_state_s, stride_chunk_s, stride_chunk_c,
    dk, dv, num_chunks, L,
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
    ratio = tl.exp(-tl.load(decay_ptr + h).to(tl.float32))
    state = tl.load(state_ptr + slot * stride_state_s + tile, mask=tile_ok, other=0.0).to(
        tl.float32
    )
    chunk_at = chunk_ptr + s * stride_chunk_s + tile
    for j in range(0, count):
        t = t0 + j
        # fmt: off
        o, state = _lightning_token(state, q_ptr, k_ptr, v_ptr, t, h, dk_i, dv_j, k_ok, v_ok,
                                    stride_t, stride_h, stride_v_t, stride_v_h, ratio)
        # fmt: on
        tl.store(o_ptr + t * stride_o_t + h * stride_o_h + dv_j, o, mask=v_ok)
        store_chunk_ends(chunk_at, stride_chunk_c, state, tile_ok, offset, j, L)
    store_tail_chunks(chunk_at, stride_chunk_c, state, tile_ok, offset, count, L, num_chunks)
    store_state(state_ptr, slot, stride_state_s, tile, state, tile_ok)


# fmt: off
@triton.jit
def _lightning_decode_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, state_ptr, slots_ptr, o_ptr,
    stride_t, stride_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h, stride_state_s, dk, dv,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # fmt: on
    b = tl.program_id(0).to(tl.int64)
    h, dk_i, dv_j, k_ok, v_ok, tile = head_tile(dk, dv, BLOCK_K, BLOCK_V)
    tile_ok = k_ok[:, None] & v_ok[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    ratio = tl.exp(-tl.load(decay_ptr + h).to(tl.float32))
    state = tl.load(state_ptr + slot * stride_state_s + tile, mask=tile_ok, other=0.0).to(
        tl.float32
    )
    # fmt: off
    o, state = _lightning_token(state, q_ptr, k_ptr, v_ptr, b, h, dk_i, dv_j, k_ok, v_ok,
                                stride_t, stride_h, stride_v_t, stride_v_h, ratio)
    # fmt: on
    tl.store(o_ptr + b * stride_o_t + h * stride_o_h + dv_j, o, mask=v_ok)
    store_state(state_ptr, slot, stride_state_s, tile, state, tile_ok)


def _lightning_args(q, k, v, decay, state_pool, what: str):
    slot_tiles(state_pool, what)
    q, k = q.contiguous(), k.contiguous()
    return q, k, v.contiguous(), decay.float().contiguous()


def lightning_prefill_pool_triton(q, k, v, decay, state_pool, slots, layout: ChunkLayout):
    """kernels/lightning.py's lightning_prefill_pool: (o, chunk_states); the final states are
    left in the pool."""
    q, k, v, decay = _lightning_args(q, k, v, decay, state_pool, "lightning_prefill")
    T, H, dk = q.shape
    dv = v.shape[-1]
    S, Cn = layout.num_seqs, layout.num_chunks
    o, chunks = scan_outputs(q, v, q.dtype, layout)
    if T == 0 or S == 0:
        return o, chunks
    BLOCK_K, BLOCK_V = v_block(dk, dv)
    # fmt: off
    _lightning_scan_kernel[(S, H, triton.cdiv(dv, BLOCK_V))](
        q, k, v, decay, state_pool, slots, layout.cu_seqlens, layout.start_pos, o, chunks,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        state_pool.stride(0), chunks.stride(0), chunks.stride(1),
        dk, dv, Cn, layout.chunk_size,
        BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=4,
    )
    # fmt: on
    return o, chunks


def lightning_decode_triton(q, k, v, decay, state_pool, slots) -> torch.Tensor:
    """kernels/lightning.py's lightning_decode."""
    q, k, v, decay = _lightning_args(q, k, v, decay, state_pool, "lightning_decode")
    batch, H, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty(batch, H, dv, device=v.device, dtype=q.dtype)
    if batch == 0:
        return o
    BLOCK_K, BLOCK_V = v_block(dk, dv)
    # fmt: off
    _lightning_decode_kernel[(batch, H, triton.cdiv(dv, BLOCK_V))](
        q, k, v, decay, state_pool, slots, o,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        state_pool.stride(0), dk, dv,
        BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=4,
    )
    # fmt: on
    return o
