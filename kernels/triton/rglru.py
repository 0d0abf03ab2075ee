"""The RG-LRU's diagonal scan, Triton path (semantics: kernels/rglru.py; the shared recurrence
scheme: kernels/triton/recurrences.py): per (sequence or row, block of channels), h <- a h + u."""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.layouts import ChunkLayout
from baton.kernels.triton.recurrences import store_chunk_ends, store_tail_chunks


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
        store_chunk_ends(chunk_at, stride_chunk_c, h, ok, offset, j, L)
    store_tail_chunks(chunk_at, stride_chunk_c, h, ok, offset, count, L, num_chunks)
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
