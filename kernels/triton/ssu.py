"""Selective state update on pool slots, Triton path (semantics: kernels/ssu.py).

    dt     = softplus(dt + dt_bias), limited to dt_limit unless it is (0, inf)
    state <- state * exp(dt * A) + dt * x ⊗ B
    y      = state · C + D * x

One program owns BLOCK_R rows (row = head * headdim + p) of one request's state, each row a whole
dstate vector: read from `state_indices`, updated in registers and written back in place. The multi-token variant
(speculative verify) reads slot state_indices[b, 0] once and writes the state after token i to
state_indices[b, i + 1], keeping the running state in registers between tokens.

Padded rows point at dummy slot 0 and write only there; no other slot is touched. A CTA barrier
separates the read of a slot from its rewrite. No autotune: these kernels write state in place.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.triton.ssd import _softplus


@triton.jit
def _discretize(dt_raw, dt_bias, dt_min, dt_max, HAS_LIMIT: tl.constexpr):
    dt = _softplus(dt_raw + dt_bias)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


# fmt: off
@triton.jit
def _ssu_kernel(
    state_ptr, x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, dt_bias_ptr, slots_ptr, y_ptr,
    stride_state_s, stride_state_h, stride_state_p, stride_state_n,
    stride_x_b, stride_x_k, stride_x_h, stride_x_p,
    stride_dt_b, stride_dt_k, stride_dt_h,
    stride_B_b, stride_B_k, stride_B_g, stride_B_n,
    stride_C_b, stride_C_k, stride_C_g, stride_C_n,
    stride_y_b, stride_y_k, stride_y_h, stride_y_p,
    stride_slots_b, stride_slots_k,
    num_tokens, H, P, N, heads_per_group, dt_min, dt_max,
    HAS_LIMIT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # fmt: on
    # Rows r = head * P + p of one request's state; a block may span several heads.
    b = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < H * P
    h, p = r // P, r % P
    g = h // heads_per_group
    n = tl.arange(0, BLOCK_N)
    tile_mask = r_ok[:, None] & (n < N)[None, :]
    tile = (h * stride_state_h + p * stride_state_p)[:, None] + n[None, :] * stride_state_n
    read_slot = tl.load(slots_ptr + b * stride_slots_b).to(tl.int64)
    state = tl.load(
        state_ptr + read_slot * stride_state_s + tile, mask=tile_mask, other=0.0
    ).to(tl.float32)
    A = tl.load(A_ptr + h, mask=r_ok, other=0.0).to(tl.float32)
    D = tl.load(D_ptr + h, mask=r_ok, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h, mask=r_ok, other=0.0).to(tl.float32)
    tl.debug_barrier()  # the slot read above may be the first slot written below
    for k in range(0, num_tokens):
        dt_raw = tl.load(
            dt_ptr + b * stride_dt_b + k * stride_dt_k + h * stride_dt_h, mask=r_ok, other=0.0
        )
        dt = _discretize(dt_raw.to(tl.float32), dt_bias, dt_min, dt_max, HAS_LIMIT)
        x = tl.load(
            x_ptr + b * stride_x_b + k * stride_x_k + h * stride_x_h + p * stride_x_p,
            mask=r_ok, other=0.0,
        ).to(tl.float32)
        B = tl.load(
            B_ptr + b * stride_B_b + k * stride_B_k
            + g[:, None] * stride_B_g + n[None, :] * stride_B_n,
            mask=tile_mask, other=0.0,
        ).to(tl.float32)
        C = tl.load(
            C_ptr + b * stride_C_b + k * stride_C_k
            + g[:, None] * stride_C_g + n[None, :] * stride_C_n,
            mask=tile_mask, other=0.0,
        ).to(tl.float32)
        state = state * tl.exp(dt * A)[:, None] + (x * dt)[:, None] * B
        write_slot = tl.load(slots_ptr + b * stride_slots_b + (k + 1) * stride_slots_k)
        tl.store(
            state_ptr + write_slot.to(tl.int64) * stride_state_s + tile,
            state.to(state_ptr.dtype.element_ty), mask=tile_mask,
        )
        y = tl.sum(state * C, axis=1) + D * x
        tl.store(
            y_ptr + b * stride_y_b + k * stride_y_k + h * stride_y_h + p * stride_y_p,
            y.to(y_ptr.dtype.element_ty), mask=r_ok,
        )


def _launch(ssm_states, x, dt, A, B, C, D, dt_bias, slots, y, dt_limit) -> None:
    """All of x, dt, B, C, y carry a token axis (size k) at dim 1 here; slots is (batch, k + 1)."""
    batch, k, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    BLOCK_N = triton.next_power_of_2(N)
    # ~2048 state elements per program: 16 rows of dstate 128 (Nano: 640 programs per request),
    # or every row of a tiny model's request at once.
    BLOCK_R = min(triton.next_power_of_2(H * P), max(1, 2048 // BLOCK_N))
    lo, hi = dt_limit
    # fmt: off
    _ssu_kernel[(batch, triton.cdiv(H * P, BLOCK_R))](
        ssm_states, x, dt, A, B, C, D, dt_bias, slots, y,
        *ssm_states.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(), *y.stride(),
        *slots.stride(),
        k, H, P, N, H // G, float(lo), float(hi),
        HAS_LIMIT=lo > 0.0 or hi != float("inf"), BLOCK_R=BLOCK_R, BLOCK_N=BLOCK_N, num_warps=4,
    )
    # fmt: on


def _check(ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, k: int | None) -> None:
    batch, H, P = x.shape[0], x.shape[-2], x.shape[-1]
    G, N = B.shape[-2], B.shape[-1]
    lead = (batch,) if k is None else (batch, k)
    if ssm_states.dim() != 4 or ssm_states.shape[1:] != (H, P, N):
        raise ValueError(f"ssm_states must be (num_slots, {H}, {P}, {N}), "
                         f"got {tuple(ssm_states.shape)}")
    if dt.shape != (*lead, H):
        raise ValueError(f"dt must be {(*lead, H)}, got {tuple(dt.shape)}")
    if B.shape != (*lead, G, N) or C.shape != (*lead, G, N):
        raise ValueError(f"B and C must be {(*lead, G, N)}, got {tuple(B.shape)}, {tuple(C.shape)}")
    if H % G:
        raise ValueError(f"nheads {H} must be a multiple of ngroups {G}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t.shape != (H,):
            raise ValueError(f"{name} must be ({H},), got {tuple(t.shape)}")
    want = (batch,) if k is None else (batch, k + 1)
    if state_indices.shape != want:
        raise ValueError(f"state_indices must be {want}, got {tuple(state_indices.shape)}")
    tensors = (ssm_states, x, dt, A, B, C, D, dt_bias, state_indices)
    if len({t.device for t in tensors}) != 1:
        raise ValueError("selective_state_update: all tensors must share one device")


def selective_state_update_triton(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """One decode step per request, in place on the pool.

    ssm_states: (num_slots, nheads, headdim, dstate) pool, float32 by default;
    x: (batch, nheads, headdim) float32/float16/bfloat16; dt: (batch, nheads) raw;
    A, D, dt_bias: (nheads,); B, C: (batch, ngroups, dstate); state_indices: (batch,) int
    (padded rows -> dummy slot 0). Any strides. Returns y: (batch, nheads, headdim), x's dtype.
    """
    _check(ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, None)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0]:
        # Token axis of size 1; state_indices[:, None] expanded to (batch, 2): read = write.
        slots = state_indices[:, None].expand(-1, 2)
        _launch(
            ssm_states, x[:, None], dt[:, None], A, B[:, None], C[:, None], D, dt_bias, slots,
            y[:, None], dt_limit,
        )
    return y


def selective_state_update_multi_triton(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:
    """k tokens per request (speculative verify), in place on the pool.

    x: (batch, k, nheads, headdim); dt: (batch, k, nheads) raw; B, C: (batch, k, ngroups,
    dstate); A, D, dt_bias: (nheads,); state_indices: (batch, k + 1) int: column 0 is the slot
    read, column i + 1 receives the state after token i. Returns y: (batch, k, nheads, headdim)
    in x's dtype.
    """
    k = x.shape[1]
    _check(ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, k)
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.shape[0] and k:
        _launch(ssm_states, x, dt, A, B, C, D, dt_bias, state_indices, y, dt_limit)
    return y
