"""Mamba1 selective scan (prefill, varlen) and decode update on pool slots, Triton path
(semantics: kernels/selective_scan.py).

    delta = softplus(dt + dt_bias);  h <- exp(delta A) h + (delta x) B;  y = h . C + D x (* silu z)

One program owns BLOCK_D channels of one sequence (prefill) or one row (decode): their
(BLOCK_D, d_state) state tile is read from the sequence's pool slot, lives in registers while
the program walks the tokens in order, and is written back in place at the end. Prefill stores
the tile at every aligned chunk end (absolute position + 1 a multiple of the chunk size) and,
after the last token, into the chunks at or past the sequence's end (the torch path's padded
no-op steps leave the final state there). Programs of one slot own disjoint channels; a CTA
barrier separates a program's read of its tile from its rewrite. Padded decode rows point at
dummy slot 0 and write only there. No autotune: these kernels write state in place.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.layouts import ChunkLayout, SelectiveScanOutput
from baton.kernels.triton.ssd import _softplus


@triton.jit
def _silu(v):
    return v / (1.0 + tl.exp(-v))


# fmt: off
@triton.jit
def _token(state, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, y_ptr, t, d, n, d_ok, n_ok, A, D, bias,
           stride_x, stride_dt, stride_bc, stride_z, stride_y, HAS_Z: tl.constexpr):
    # fmt: on
    """One token of the recurrence on the state tile; stores y and returns the new tile."""
    x = tl.load(x_ptr + t * stride_x + d, mask=d_ok, other=0.0).to(tl.float32)
    raw = tl.load(dt_ptr + t * stride_dt + d, mask=d_ok, other=0.0).to(tl.float32)
    Bt = tl.load(B_ptr + t * stride_bc + n, mask=n_ok, other=0.0).to(tl.float32)
    Ct = tl.load(C_ptr + t * stride_bc + n, mask=n_ok, other=0.0).to(tl.float32)
    delta = _softplus(raw + bias)
    state = state * tl.exp(delta[:, None] * A) + (delta * x)[:, None] * Bt[None, :]
    y = tl.sum(state * Ct[None, :], axis=1) + D * x
    if HAS_Z:
        y = y * _silu(tl.load(z_ptr + t * stride_z + d, mask=d_ok, other=0.0).to(tl.float32))
    tl.store(y_ptr + t * stride_y + d, y.to(y_ptr.dtype.element_ty), mask=d_ok)
    return state


# fmt: off
@triton.jit
def _scan_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, z_ptr, state_ptr, slots_ptr,
    cu_ptr, start_ptr, y_ptr, chunk_ptr,
    stride_x, stride_dt, stride_bc, stride_z, stride_y,
    stride_state_s, stride_chunk_s, stride_chunk_c,
    width, N, num_chunks, L,
    HAS_Z: tl.constexpr, WANT_CHUNKS: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # fmt: on
    s = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < width, n < N
    tile_ok = d_ok[:, None] & n_ok[None, :]
    tile = d[:, None] * N + n[None, :]  # a slot's (d_inner, d_state) block is contiguous
    t0 = tl.load(cu_ptr + s).to(tl.int64)
    count = tl.load(cu_ptr + s + 1).to(tl.int64) - t0
    offset = tl.load(start_ptr + s).to(tl.int64) % L
    slot = tl.load(slots_ptr + s).to(tl.int64)
    state = tl.load(state_ptr + slot * stride_state_s + tile, mask=tile_ok, other=0.0).to(
        tl.float32
    )
    A = tl.load(A_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    D = tl.load(D_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    chunk_at = chunk_ptr + s * stride_chunk_s + tile
    for j in range(0, count):
        # fmt: off
        state = _token(state, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, y_ptr, t0 + j, d, n, d_ok,
                       n_ok, A, D, bias, stride_x, stride_dt, stride_bc, stride_z, stride_y,
                       HAS_Z)
        # fmt: on
        if WANT_CHUNKS:
            if (offset + j + 1) % L == 0:
                tl.store(chunk_at + (offset + j) // L * stride_chunk_c, state, mask=tile_ok)
    if WANT_CHUNKS:
        for k in range((offset + count) // L, num_chunks):
            tl.store(chunk_at + k * stride_chunk_c, state, mask=tile_ok)
    tl.debug_barrier()  # every thread has read its part of the slot before any rewrites it
    tl.store(state_ptr + slot * stride_state_s + tile, state.to(state_ptr.dtype.element_ty),
             mask=tile_ok)


# fmt: off
@triton.jit
def _update_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, z_ptr, state_ptr, slots_ptr, y_ptr,
    stride_x, stride_dt, stride_bc, stride_z, stride_y, stride_state_s,
    width, N,
    HAS_Z: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # fmt: on
    b = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < width, n < N
    tile_ok = d_ok[:, None] & n_ok[None, :]
    tile = d[:, None] * N + n[None, :]
    slot = tl.load(slots_ptr + b).to(tl.int64)
    state = tl.load(state_ptr + slot * stride_state_s + tile, mask=tile_ok, other=0.0).to(
        tl.float32
    )
    A = tl.load(A_ptr + tile, mask=tile_ok, other=0.0).to(tl.float32)
    D = tl.load(D_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    # fmt: off
    state = _token(state, x_ptr, dt_ptr, B_ptr, C_ptr, z_ptr, y_ptr, b, d, n, d_ok, n_ok, A, D,
                   bias, stride_x, stride_dt, stride_bc, stride_z, stride_y, HAS_Z)
    # fmt: on
    tl.debug_barrier()
    tl.store(state_ptr + slot * stride_state_s + tile, state.to(state_ptr.dtype.element_ty),
             mask=tile_ok)


def _blocks(width: int, N: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N): ~2048 state elements per program, at least 16 channels."""
    BLOCK_N = triton.next_power_of_2(N)
    BLOCK_D = min(triton.next_power_of_2(width), max(16, 2048 // BLOCK_N))
    return BLOCK_D, BLOCK_N


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check(states, x, dt, A, B, C, D, dt_bias, z, slots) -> None:
    rows, width = x.shape
    N = A.shape[1]
    if A.shape != (width, N):
        raise ValueError(f"A must be ({width}, d_state), got {tuple(A.shape)}")
    if dt.shape != x.shape or (z is not None and z.shape != x.shape):
        raise ValueError(f"dt and z must be {tuple(x.shape)} like x")
    if B.shape != (rows, N) or C.shape != (rows, N):
        raise ValueError(f"B and C must be ({rows}, {N}), got {tuple(B.shape)}, {tuple(C.shape)}")
    for name, t in (("D", D), ("dt_bias", dt_bias)):
        if t.shape != (width,):
            raise ValueError(f"{name} must be ({width},), got {tuple(t.shape)}")
    if states.dim() != 3 or states.shape[1:] != (width, N) or not states[0].is_contiguous():
        raise ValueError(f"states must be (slots, {width}, {N}) with contiguous slots")
    tensors = [states, x, dt, A, B, C, D, dt_bias, slots] + ([z] if z is not None else [])
    if len({t.device for t in tensors}) != 1:
        raise ValueError("selective scan: all tensors must share one device")


def selective_scan_pool_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor | None,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    layout: ChunkLayout,
    want_chunk_states: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """baton.kernels.selective_scan.selective_scan_pool: states read from and left in
    ssm_pool[slots] (num_seqs,). Returns y (T, d_inner) in x's dtype and, when asked for, the
    float32 chunk-end states (S, num_chunks, d_inner, d_state)."""
    _check(ssm_pool, x, dt, A, B, C, D, dt_bias, z, slots)
    T, width = x.shape
    N = A.shape[1]
    S, Cn = layout.num_seqs, layout.num_chunks
    x, dt, B, C = _rows(x), _rows(dt), _rows(B), _rows(C)
    if B.stride(0) != C.stride(0):
        B, C = B.contiguous(), C.contiguous()
    z = _rows(z) if z is not None else None
    A = A.float().contiguous()
    y = torch.empty(T, width, device=x.device, dtype=x.dtype)
    chunks = torch.empty(
        (S, Cn, width, N) if want_chunk_states else (1, 1, width, N),
        device=x.device,
        dtype=torch.float32,
    )
    if T == 0 or S == 0:
        return y, chunks if want_chunk_states else None
    BLOCK_D, BLOCK_N = _blocks(width, N)
    # fmt: off
    _scan_kernel[(S, triton.cdiv(width, BLOCK_D))](
        x, dt, A, B, C, D, dt_bias, z if z is not None else x, ssm_pool, slots,
        layout.cu_seqlens, layout.start_pos, y, chunks,
        x.stride(0), dt.stride(0), B.stride(0), z.stride(0) if z is not None else 0, y.stride(0),
        ssm_pool.stride(0), chunks.stride(0), chunks.stride(1),
        width, N, Cn, layout.chunk_size,
        HAS_Z=z is not None, WANT_CHUNKS=want_chunk_states, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N,
        num_warps=4,
    )
    # fmt: on
    return y, chunks if want_chunk_states else None


def selective_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor | None,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
) -> SelectiveScanOutput:
    """baton.kernels.selective_scan.selective_scan (initial_states (S, d_inner, d_state) not written)."""
    states = initial_states.float().contiguous().clone()
    slots = torch.arange(states.shape[0], device=x.device)
    y, chunks = selective_scan_pool_triton(
        x, dt, A, B, C, D, dt_bias, z, states, slots, layout, want_chunk_states=True
    )
    return SelectiveScanOutput(y=y, final_states=states, chunk_states=chunks)


def selective_state_update_triton(
    ssm_pool: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor | None,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """baton.kernels.selective_scan.selective_state_update: one token per row (batch,)."""
    _check(ssm_pool, x, dt, A, B, C, D, dt_bias, z, state_indices)
    batch, width = x.shape
    N = A.shape[1]
    x, dt, B, C = _rows(x), _rows(dt), _rows(B), _rows(C)
    if B.stride(0) != C.stride(0):
        B, C = B.contiguous(), C.contiguous()
    z = _rows(z) if z is not None else None
    y = torch.empty(batch, width, device=x.device, dtype=x.dtype)
    if batch == 0:
        return y
    BLOCK_D, BLOCK_N = _blocks(width, N)
    # fmt: off
    _update_kernel[(batch, triton.cdiv(width, BLOCK_D))](
        x, dt, A.float().contiguous(), B, C, D, dt_bias, z if z is not None else x, ssm_pool,
        state_indices, y,
        x.stride(0), dt.stride(0), B.stride(0), z.stride(0) if z is not None else 0, y.stride(0),
        ssm_pool.stride(0),
        width, N,
        HAS_Z=z is not None, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, num_warps=4,
    )
    # fmt: on
    return y
