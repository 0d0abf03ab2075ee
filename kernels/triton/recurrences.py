"""Triton paths of the slot-state recurrences that have no chunked Triton form here yet: Kimi Delta
Attention (kernels/kda.py), lightning attention (kernels/lightning.py) and the RG-LRU's diagonal
scan (kernels/rglru.py). Semantics and shapes are those modules'; these launchers are what they
dispatch to for CUDA tensors (or under BATON_KERNELS=triton).

Every kernel is the recurrence itself, token by token (FLA's "fused recurrent" form): one program
owns one sequence (prefill) or one row (decode), one head and a block of the state's value
columns (RG-LRU: a block of channels), keeps that state tile in registers in float32 while it
walks the sequence's tokens in order, and writes it back in place at the end. Prefill stores the
tile at every aligned chunk end (absolute position + 1 a multiple of the chunk size: the prefix
checkpoints) and, after the last token, into every chunk at or past the sequence's end, which is
what the torch paths' padded no-op slots leave there. A recurrent prefill is linear in the
prompt; a chunked (tensor-core) prefill is the next step where prompts are long.

Programs of one slot own disjoint columns; a CTA barrier separates a program's reads of its tile
from its rewrite. KDA's padded decode rows (slot 0) neither read nor write and give o = 0, as the
torch path; lightning's and the RG-LRU's write the dummy slot 0, as theirs do. No autotune: these
kernels write state in place.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.layouts import ChunkLayout

L2NORM_EPS = 1e-6  # kernels/kda.py's (transformers' and FLA's l2norm eps)


@triton.jit
def _store_chunk_ends(chunk_at, stride_c, state, mask, offset, j, L):
    """The state after token j (of a sequence whose first token sits at `offset` in its chunk)
    when that token closes an aligned chunk."""
    if (offset + j + 1) % L == 0:
        tl.store(chunk_at + (offset + j) // L * stride_c, state, mask=mask)


@triton.jit
def _store_tail_chunks(chunk_at, stride_c, state, mask, offset, count, L, num_chunks):
    for c in range((offset + count) // L, num_chunks):
        tl.store(chunk_at + c * stride_c, state, mask=mask)


# -- KDA -------------------------------------------------------------------------------------


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
    h = tl.program_id(1)
    dk_i = tl.arange(0, BLOCK_K)
    dv_j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = dk_i < dk, dv_j < dv
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = h * dk * dv + dk_i[:, None] * dv + dv_j[None, :]  # a slot is (H, dk, dv) contiguous
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
        _store_chunk_ends(chunk_at, stride_chunk_c, state, tile_ok, offset, j, L)
    _store_tail_chunks(chunk_at, stride_chunk_c, state, tile_ok, offset, count, L, num_chunks)
    tl.debug_barrier()  # every thread has read its part of the slot before any rewrites it
    tl.store(state_ptr + slot * stride_state_s + tile, state.to(state_ptr.dtype.element_ty),
             mask=tile_ok)


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
    h = tl.program_id(1)
    dk_i = tl.arange(0, BLOCK_K)
    dv_j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = dk_i < dk, dv_j < dv
    tile = h * dk * dv + dk_i[:, None] * dv + dv_j[None, :]
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
    tl.debug_barrier()
    tl.store(state_ptr + slot * stride_state_s + tile, state.to(state_ptr.dtype.element_ty),
             mask=tile_ok)


def _qk_like(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor):
    """q, k and g with one shared (token, head) stride pair and unit channel stride."""
    q, k, g = q.contiguous(), k.contiguous(), g.float().contiguous()
    return q, k, g


def _slot_tiles(states: torch.Tensor, what: str) -> None:
    if not states[0].is_contiguous():
        raise ValueError(f"{what}: each state slot must be contiguous")


def _v_block(dk: int, dv: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): the whole key dim, ~4096 state elements per program."""
    BLOCK_K = triton.next_power_of_2(dk)
    return BLOCK_K, min(triton.next_power_of_2(dv), max(16, 4096 // BLOCK_K))


def kda_prefill_triton(q, k, v, g, beta, state_pool, state_indices, layout: ChunkLayout):
    """kernels/kda.py's kda_prefill (arguments checked there): (o, chunk_states)."""
    _slot_tiles(state_pool, "kda_prefill")
    q, k, g = _qk_like(q, k, g)
    v, beta = v.contiguous(), beta.float().contiguous()
    T, H, dk = q.shape
    dv = v.shape[-1]
    S, Cn = layout.num_seqs, layout.num_chunks
    o = torch.empty(T, H, dv, device=v.device, dtype=v.dtype)
    chunks = torch.empty(S, Cn, H, dk, dv, device=v.device, dtype=torch.float32)
    if T == 0 or S == 0:
        return o, chunks
    BLOCK_K, BLOCK_V = _v_block(dk, dv)
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
    _slot_tiles(state_pool, "kda_decode")
    q, k, g = _qk_like(q, k, g)
    v, beta = v.contiguous(), beta.float().contiguous()
    batch, H, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty(batch, H, dv, device=v.device, dtype=v.dtype)
    if batch == 0:
        return o
    BLOCK_K, BLOCK_V = _v_block(dk, dv)
    # fmt: off
    _kda_decode_kernel[(batch, H, triton.cdiv(dv, BLOCK_V))](
        q, k, v, g, beta, state_pool, state_indices, o,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), beta.stride(0), o.stride(0),
        o.stride(1), state_pool.stride(0), dk, dv, dk**-0.5, L2NORM_EPS,
        BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=4,
    )
    # fmt: on
    return o


# -- lightning attention ---------------------------------------------------------------------


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
    h = tl.program_id(1)
    dk_i = tl.arange(0, BLOCK_K)
    dv_j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = dk_i < dk, dv_j < dv
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = h * dk * dv + dk_i[:, None] * dv + dv_j[None, :]
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
        _store_chunk_ends(chunk_at, stride_chunk_c, state, tile_ok, offset, j, L)
    _store_tail_chunks(chunk_at, stride_chunk_c, state, tile_ok, offset, count, L, num_chunks)
    tl.debug_barrier()
    tl.store(state_ptr + slot * stride_state_s + tile, state.to(state_ptr.dtype.element_ty),
             mask=tile_ok)


# fmt: off
@triton.jit
def _lightning_decode_kernel(
    q_ptr, k_ptr, v_ptr, decay_ptr, state_ptr, slots_ptr, o_ptr,
    stride_t, stride_h, stride_v_t, stride_v_h, stride_o_t, stride_o_h, stride_state_s, dk, dv,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # fmt: on
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dk_i = tl.arange(0, BLOCK_K)
    dv_j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_ok, v_ok = dk_i < dk, dv_j < dv
    tile_ok = k_ok[:, None] & v_ok[None, :]
    tile = h * dk * dv + dk_i[:, None] * dv + dv_j[None, :]
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
    tl.debug_barrier()
    tl.store(state_ptr + slot * stride_state_s + tile, state.to(state_ptr.dtype.element_ty),
             mask=tile_ok)


def _lightning_args(q, k, v, decay, state_pool, what: str):
    _slot_tiles(state_pool, what)
    q, k = q.contiguous(), k.contiguous()
    return q, k, v.contiguous(), decay.float().contiguous()


def lightning_prefill_pool_triton(q, k, v, decay, state_pool, slots, layout: ChunkLayout):
    """kernels/lightning.py's lightning_prefill_pool: (o, chunk_states); the final states are
    left in the pool."""
    q, k, v, decay = _lightning_args(q, k, v, decay, state_pool, "lightning_prefill")
    T, H, dk = q.shape
    dv = v.shape[-1]
    S, Cn = layout.num_seqs, layout.num_chunks
    o = torch.empty(T, H, dv, device=v.device, dtype=q.dtype)
    chunks = torch.empty(S, Cn, H, dk, dv, device=v.device, dtype=torch.float32)
    if T == 0 or S == 0:
        return o, chunks
    BLOCK_K, BLOCK_V = _v_block(dk, dv)
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
    BLOCK_K, BLOCK_V = _v_block(dk, dv)
    # fmt: off
    _lightning_decode_kernel[(batch, H, triton.cdiv(dv, BLOCK_V))](
        q, k, v, decay, state_pool, slots, o,
        q.stride(0), q.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        state_pool.stride(0), dk, dv,
        BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, num_warps=4,
    )
    # fmt: on
    return o


# -- RG-LRU ----------------------------------------------------------------------------------


# fmt: off
@triton.jit
def _rglru_scan_kernel(
    a_ptr, u_ptr, state_ptr, slots_ptr, cu_ptr, start_ptr, y_ptr, chunk_ptr,
    stride_a, stride_u, stride_y, stride_state_s, stride_chunk_s, stride_chunk_c,
    width, num_chunks, L,
    BLOCK_W: tl.constexpr,
):
    # fmt: on
    s = tl.program_id(0)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = w < width
    t0 = tl.load(cu_ptr + s).to(tl.int64)
    count = tl.load(cu_ptr + s + 1).to(tl.int64) - t0
    offset = tl.load(start_ptr + s).to(tl.int64) % L
    slot = tl.load(slots_ptr + s).to(tl.int64)
    h = tl.load(state_ptr + slot * stride_state_s + w, mask=ok, other=0.0).to(tl.float32)
    chunk_at = chunk_ptr + s * stride_chunk_s + w
    for j in range(0, count):
        t = t0 + j
        a = tl.load(a_ptr + t * stride_a + w, mask=ok, other=1.0).to(tl.float32)
        u = tl.load(u_ptr + t * stride_u + w, mask=ok, other=0.0).to(tl.float32)
        h = a * h + u
        tl.store(y_ptr + t * stride_y + w, h.to(y_ptr.dtype.element_ty), mask=ok)
        _store_chunk_ends(chunk_at, stride_chunk_c, h, ok, offset, j, L)
    _store_tail_chunks(chunk_at, stride_chunk_c, h, ok, offset, count, L, num_chunks)
    tl.debug_barrier()
    tl.store(state_ptr + slot * stride_state_s + w, h.to(state_ptr.dtype.element_ty), mask=ok)


# fmt: off
@triton.jit
def _rglru_update_kernel(
    a_ptr, u_ptr, state_ptr, slots_ptr, y_ptr, stride_a, stride_u, stride_y, stride_state_s,
    width, BLOCK_W: tl.constexpr,
):
    # fmt: on
    b = tl.program_id(0).to(tl.int64)
    w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    ok = w < width
    slot = tl.load(slots_ptr + b).to(tl.int64)
    h = tl.load(state_ptr + slot * stride_state_s + w, mask=ok, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + b * stride_a + w, mask=ok, other=1.0).to(tl.float32)
    u = tl.load(u_ptr + b * stride_u + w, mask=ok, other=0.0).to(tl.float32)
    h = a * h + u
    tl.store(y_ptr + b * stride_y + w, h.to(y_ptr.dtype.element_ty), mask=ok)
    tl.debug_barrier()
    tl.store(state_ptr + slot * stride_state_s + w, h.to(state_ptr.dtype.element_ty), mask=ok)


def _rglru_args(a, u, state_pool, what: str):
    if state_pool.dim() != 2 or state_pool.stride(1) != 1:
        raise ValueError(f"{what}: the state pool must be (slots, width) with unit column stride")
    return a.contiguous(), u.contiguous()


def _width_block(width: int) -> int:
    return min(triton.next_power_of_2(width), 1024)


def rglru_scan_pool_triton(a, u, state_pool, slots, layout: ChunkLayout):
    """kernels/rglru.py's rglru_scan_pool: (y, chunk_states); the final states are left in the
    pool."""
    a, u = _rglru_args(a, u, state_pool, "rglru_scan")
    T, width = u.shape
    S, Cn = layout.num_seqs, layout.num_chunks
    y = torch.empty(T, width, device=u.device, dtype=u.dtype)
    chunks = torch.empty(S, Cn, width, device=u.device, dtype=torch.float32)
    if T == 0 or S == 0:
        return y, chunks
    BLOCK_W = _width_block(width)
    # fmt: off
    _rglru_scan_kernel[(S, triton.cdiv(width, BLOCK_W))](
        a, u, state_pool, slots, layout.cu_seqlens, layout.start_pos, y, chunks,
        a.stride(0), u.stride(0), y.stride(0), state_pool.stride(0), chunks.stride(0),
        chunks.stride(1), width, Cn, layout.chunk_size,
        BLOCK_W=BLOCK_W, num_warps=4,
    )
    # fmt: on
    return y, chunks


def rglru_update_triton(a, u, state_pool, slots) -> torch.Tensor:
    """kernels/rglru.py's rglru_update."""
    a, u = _rglru_args(a, u, state_pool, "rglru_update")
    batch, width = u.shape
    y = torch.empty(batch, width, device=u.device, dtype=u.dtype)
    if batch == 0:
        return y
    BLOCK_W = _width_block(width)
    # fmt: off
    _rglru_update_kernel[(batch, triton.cdiv(width, BLOCK_W))](
        a, u, state_pool, slots, y, a.stride(0), u.stride(0), y.stride(0), state_pool.stride(0),
        width, BLOCK_W=BLOCK_W, num_warps=4,
    )
    # fmt: on
    return y
