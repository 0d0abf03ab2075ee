"""SSD chunked scan over a packed varlen batch, Triton path (semantics: kernels/ssd.py).

Four launches, the mamba_ssm decomposition, each over *logical* chunks: chunk c of sequence s
covers absolute positions [(start_pos[s] // L + c) * L, ... + L), so slot l of that chunk holds
the packed token cu_seqlens[s] + c * L + l - start_pos[s] % L when that local index lies in
[0, seq_len). Other slots are empty and act as dt = 0 no-ops, exactly as in the torch path.

    1. _chunk_cumsum  dt = softplus(dt + dt_bias) (limited), dA_cumsum = cumsum_l(dt * A)
                      -> dt_chunk, dA_cumsum: (num_seqs, num_chunks, nheads, L) float32
    2. _chunk_state   state contributed by each chunk alone, decayed to the chunk end
                      -> written into chunk_states (num_seqs, num_chunks, nheads, P, N)
    3. _state_passing state_c = state_{c-1} * exp(dA_cumsum[c, -1]) + alone_c, in place, from
                      initial_states; chunks past a sequence's end keep its final state
    4. _chunk_scan    y = C . state_{c-1} * exp(dA_cumsum) + causal (C B^T * decay * dt) x + D x

Programs for chunks past a sequence's last chunk return at once (the grid is num_seqs x
num_chunks with num_chunks of the longest sequence). Every load is upcast to float32 at once
and all accumulation is float32; tl.dot on float32 operands uses TF32 on a GPU.
C B^T is recomputed per head inside _chunk_scan (mamba_ssm precomputes it per group); a
separate per-group kernel is the obvious next step if profiling says the scan is compute-bound.
No kernel here writes a pool, and none autotunes.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.backend import dot_precision
from baton.kernels.layouts import ChunkLayout, SSDOutput


@triton.jit
def _chunk_coords(cu_ptr, start_pos_ptr, s, L):
    """Packed offset of sequence s, its length, and its offset inside its first chunk."""
    tok0 = tl.load(cu_ptr + s).to(tl.int64)
    seq_len = tl.load(cu_ptr + s + 1).to(tl.int64) - tok0
    offset = tl.load(start_pos_ptr + s).to(tl.int64) % L
    return tok0, seq_len, offset


@triton.jit
def _softplus(v):
    """torch's softplus: log1p(exp(v)), v itself above 20. log1p(u) = log(w) * u / (w - 1) with
    w = 1 + u keeps full precision for the small dt Mamba2 lives on (plain log(1 + u) loses
    ~1e-4 relative at dt ~ 1e-3) and needs no libdevice, so the interpreter runs it too."""
    u = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + u
    rounded_u = w - 1.0  # 0 when u is below half an ulp of 1: then log1p(u) = u
    exact = rounded_u == 0.0
    log1p = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, rounded_u)))
    return tl.where(v <= 20.0, log1p, v)


# fmt: off
@triton.jit
def _chunk_cumsum_kernel(
    dt_ptr, dt_bias_ptr, A_ptr, cu_ptr, start_pos_ptr, dt_out_ptr, dA_cs_ptr,
    stride_dt_t, stride_dt_h,
    H, L, num_chunks, dt_min, dt_max,
    HAS_LIMIT: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # fmt: on
    sc = tl.program_id(0).to(tl.int64)
    s, c = sc // num_chunks, sc % num_chunks
    tok0, seq_len, offset = _chunk_coords(cu_ptr, start_pos_ptr, s, L)
    if c * L >= offset + seq_len:  # past this sequence's last chunk
        return
    l = tl.arange(0, BLOCK_L)
    local = c * L + l - offset
    valid_l = (l < L) & (local >= 0) & (local < seq_len)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < H
    valid = valid_l[:, None] & h_ok[None, :]
    raw = tl.load(
        dt_ptr + (tok0 + local)[:, None] * stride_dt_t + h[None, :] * stride_dt_h,
        mask=valid, other=0.0,
    ).to(tl.float32)
    bias = tl.load(dt_bias_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    dt = _softplus(raw + bias[None, :])
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    dt = tl.where(valid, dt, 0.0)  # empty slots are exact no-ops
    A = tl.load(A_ptr + h, mask=h_ok, other=0.0).to(tl.float32)
    dA_cs = tl.cumsum(dt * A[None, :], axis=0)
    out = (sc * H + h[None, :]) * L + l[:, None]  # (num_seqs, num_chunks, H, L) contiguous
    store_mask = (l < L)[:, None] & h_ok[None, :]
    tl.store(dt_out_ptr + out, dt, mask=store_mask)
    tl.store(dA_cs_ptr + out, dA_cs, mask=store_mask)


# fmt: off
@triton.jit
def _chunk_state_kernel(
    x_ptr, B_ptr, dt_ptr, dA_cs_ptr, cu_ptr, start_pos_ptr, states_ptr,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    H, P, N, L, num_chunks, heads_per_group,
    BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    sc = tl.program_id(0).to(tl.int64)
    s, c = sc // num_chunks, sc % num_chunks
    tok0, seq_len, offset = _chunk_coords(cu_ptr, start_pos_ptr, s, L)
    if c * L >= offset + seq_len:  # past this sequence's last chunk
        return
    h = tl.program_id(1)
    g = h // heads_per_group
    n_blocks = tl.cdiv(N, BLOCK_N)
    p = (tl.program_id(2) // n_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (tl.program_id(2) % n_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    chunk_row = (sc * H + h) * L
    dA_last = tl.load(dA_cs_ptr + chunk_row + L - 1)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, L, BLOCK_K):
        l = k0 + tl.arange(0, BLOCK_K)
        local = c * L + l - offset
        valid = (l < L) & (local >= 0) & (local < seq_len)
        tok = tok0 + local
        x = tl.load(
            x_ptr + tok[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
            mask=valid[:, None] & (p < P)[None, :], other=0.0,
        ).to(tl.float32)
        b = tl.load(
            B_ptr + tok[:, None] * stride_B_t + g * stride_B_g + n[None, :] * stride_B_n,
            mask=valid[:, None] & (n < N)[None, :], other=0.0,
        ).to(tl.float32)
        dt = tl.load(dt_ptr + chunk_row + l, mask=l < L, other=0.0)
        dA_cs = tl.load(dA_cs_ptr + chunk_row + l, mask=l < L, other=0.0)
        weight = tl.exp(dA_last - dA_cs) * dt  # 0 on empty slots (dt = 0)
        acc += tl.dot(tl.trans(x * weight[:, None]), b, input_precision=DOT_PRECISION)
    out = ((sc * H + h) * P + p[:, None]) * N + n[None, :]
    tl.store(states_ptr + out, acc, mask=(p < P)[:, None] & (n < N)[None, :])


# fmt: off
@triton.jit
def _state_passing_kernel(
    states_ptr, init_ptr, final_ptr, dA_cs_ptr, cu_ptr, start_pos_ptr,
    stride_init_s, stride_init_h, stride_init_p, stride_init_n,
    H, P, N, L, num_chunks,
    BLOCK: tl.constexpr,
):
    # fmt: on
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    tok0, seq_len, offset = _chunk_coords(cu_ptr, start_pos_ptr, s, L)
    seq_chunks = tl.cdiv(offset + seq_len, L)
    e = tl.program_id(2) * BLOCK + tl.arange(0, BLOCK)  # flat (p, n)
    e_ok = e < P * N
    p, n = e // N, e % N
    state = tl.load(
        init_ptr + s * stride_init_s + h * stride_init_h + p * stride_init_p + n * stride_init_n,
        mask=e_ok, other=0.0,
    ).to(tl.float32)
    for c in range(0, num_chunks):
        # Past the sequence's end: decay 1 and no input, so the final state repeats. (Masks
        # are built by comparison, not `block & scalar_bool`, which the interpreter mistypes.)
        live_elems = tl.where(c < seq_chunks, P * N, 0)
        dA_last = tl.load(
            dA_cs_ptr + ((s * num_chunks + c) * H + h) * L + L - 1, mask=c < seq_chunks, other=0.0
        )
        at = ((s * num_chunks + c) * H + h) * P * N + e
        alone = tl.load(states_ptr + at, mask=e < live_elems, other=0.0)
        state = state * tl.exp(dA_last) + alone
        tl.store(states_ptr + at, state, mask=e_ok)
    tl.store(final_ptr + (s * H + h) * P * N + e, state, mask=e_ok)


# fmt: off
@triton.jit
def _chunk_scan_kernel(
    x_ptr, B_ptr, C_ptr, D_ptr, dt_ptr, dA_cs_ptr, cu_ptr, start_pos_ptr,
    states_ptr, init_ptr, y_ptr,
    stride_x_t, stride_x_h, stride_x_p,
    stride_B_t, stride_B_g, stride_B_n,
    stride_C_t, stride_C_g, stride_C_n,
    stride_init_s, stride_init_h, stride_init_p, stride_init_n,
    stride_y_t, stride_y_h, stride_y_p,
    H, P, N, L, num_chunks, heads_per_group,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    sc = tl.program_id(0).to(tl.int64)
    s, c = sc // num_chunks, sc % num_chunks
    tok0, seq_len, offset = _chunk_coords(cu_ptr, start_pos_ptr, s, L)
    if c * L >= offset + seq_len:  # past this sequence's last chunk
        return
    h = tl.program_id(1)
    g = h // heads_per_group
    p_blocks = tl.cdiv(P, BLOCK_P)
    m_start = (tl.program_id(2) // p_blocks) * BLOCK_M
    m = m_start + tl.arange(0, BLOCK_M)
    p = (tl.program_id(2) % p_blocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    local_m = c * L + m - offset
    valid_m = (m < L) & (local_m >= 0) & (local_m < seq_len)
    tok_m = tok0 + local_m
    chunk_row = (sc * H + h) * L
    C_m = tl.load(
        C_ptr + tok_m[:, None] * stride_C_t + g * stride_C_g + n[None, :] * stride_C_n,
        mask=valid_m[:, None] & n_ok[None, :], other=0.0,
    ).to(tl.float32)
    dA_m = tl.load(dA_cs_ptr + chunk_row + m, mask=m < L, other=0.0)

    # State entering the chunk: the initial state for chunk 0, else the state after chunk c-1.
    # Loaded transposed, (N, P), so C_m @ state^T gives (M, P).
    init_n = tl.where(c == 0, N, 0)  # (a limit, not `mask & scalar_bool`: see above)
    from_init = tl.load(
        init_ptr + s * stride_init_s + h * stride_init_h
        + p[None, :] * stride_init_p + n[:, None] * stride_init_n,
        mask=(n < init_n)[:, None] & p_ok[None, :], other=0.0,
    ).to(tl.float32)
    prev_n = tl.where(c > 0, N, 0)
    prev = ((sc - 1) * H + h) * P * N + p[None, :] * N + n[:, None]
    from_prev = tl.load(states_ptr + prev, mask=(n < prev_n)[:, None] & p_ok[None, :], other=0.0)
    acc = tl.dot(C_m, from_init + from_prev, input_precision=DOT_PRECISION)
    acc = acc * tl.exp(dA_m)[:, None]

    # Inside the chunk, causal: sum over k <= m of (C_m . B_k) exp(dA_m - dA_k) dt_k x_k.
    for k0 in range(0, tl.minimum(m_start + BLOCK_M, L), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        local_k = c * L + k - offset
        valid_k = (k < L) & (local_k >= 0) & (local_k < seq_len)
        tok_k = tok0 + local_k
        B_k = tl.load(
            B_ptr + tok_k[:, None] * stride_B_t + g * stride_B_g + n[None, :] * stride_B_n,
            mask=valid_k[:, None] & n_ok[None, :], other=0.0,
        ).to(tl.float32)
        dA_k = tl.load(dA_cs_ptr + chunk_row + k, mask=k < L, other=0.0)
        dt_k = tl.load(dt_ptr + chunk_row + k, mask=k < L, other=0.0)
        causal = m[:, None] >= k[None, :]
        decay = tl.where(causal, tl.exp(tl.minimum(dA_m[:, None] - dA_k[None, :], 0.0)), 0.0)
        weight = tl.dot(C_m, tl.trans(B_k), input_precision=DOT_PRECISION)
        weight = weight * decay * dt_k[None, :]
        x_k = tl.load(
            x_ptr + tok_k[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
            mask=valid_k[:, None] & p_ok[None, :], other=0.0,
        ).to(tl.float32)
        acc += tl.dot(weight, x_k, input_precision=DOT_PRECISION)

    mp_mask = valid_m[:, None] & p_ok[None, :]
    x_m = tl.load(
        x_ptr + tok_m[:, None] * stride_x_t + h * stride_x_h + p[None, :] * stride_x_p,
        mask=mp_mask, other=0.0,
    ).to(tl.float32)
    acc += tl.load(D_ptr + h).to(tl.float32) * x_m
    tl.store(
        y_ptr + tok_m[:, None] * stride_y_t + h * stride_y_h + p[None, :] * stride_y_p,
        acc.to(y_ptr.dtype.element_ty), mask=mp_mask,
    )


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def ssd_scan_triton(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> SSDOutput:
    """Chunked SSD scan of a packed varlen batch (same contract as baton.kernels.ssd.ssd_scan).

    x: (num_tokens, nheads, headdim) float32/float16/bfloat16, any strides;
    dt: (num_tokens, nheads) raw, any float dtype; A, D, dt_bias: (nheads,) any float dtype;
    B, C: (num_tokens, ngroups, dstate), any float dtype and strides;
    initial_states: (num_seqs, nheads, headdim, dstate), any float dtype (float32 expected);
    layout: uses num_seqs, num_chunks, chunk_size, cu_seqlens (num_seqs + 1,) int32 and
    start_pos (num_seqs,) int64 only (not the torch path's gather indices).
    Returns y (num_tokens, nheads, headdim) in x's dtype, final_states (num_seqs, nheads,
    headdim, dstate) float32 and chunk_states (num_seqs, num_chunks, nheads, headdim, dstate)
    float32 (chunks past a sequence's end hold its final state).
    """
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S, Cn, L = layout.num_seqs, layout.num_chunks, layout.chunk_size
    if dt.shape != (T, H):
        raise ValueError(f"dt must be (num_tokens, nheads) = {(T, H)}, got {tuple(dt.shape)}")
    if B.shape != (T, G, N) or C.shape != (T, G, N):
        raise ValueError(f"B and C must both be (num_tokens, ngroups, dstate) = {(T, G, N)}, "
                         f"got {tuple(B.shape)} and {tuple(C.shape)}")
    if H % G:
        raise ValueError(f"nheads {H} must be a multiple of ngroups {G}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if t.shape != (H,):
            raise ValueError(f"{name} must be (nheads,) = ({H},), got {tuple(t.shape)}")
    if initial_states.shape != (S, H, P, N):
        raise ValueError(f"initial_states must be (num_seqs, nheads, headdim, dstate) = "
                         f"{(S, H, P, N)}, got {tuple(initial_states.shape)}")
    if layout.cu_seqlens.shape != (S + 1,) or layout.start_pos.shape != (S,):
        raise ValueError("layout.cu_seqlens must be (num_seqs + 1,) and start_pos (num_seqs,)")
    devices = {t.device for t in (x, dt, A, B, C, D, dt_bias, initial_states, layout.cu_seqlens,
                                   layout.start_pos)}
    if len(devices) != 1:
        raise ValueError(f"ssd_scan_triton: all tensors must share one device, got {devices}")

    device = x.device
    y = torch.empty(T, H, P, device=device, dtype=x.dtype)
    final_states = torch.empty(S, H, P, N, device=device, dtype=torch.float32)
    chunk_states = torch.empty(S, Cn, H, P, N, device=device, dtype=torch.float32)
    if S == 0:
        return SSDOutput(y=y, final_states=final_states, chunk_states=chunk_states)
    dt_chunk = torch.empty(S, Cn, H, L, device=device, dtype=torch.float32)
    dA_cs = torch.empty_like(dt_chunk)
    cu, start_pos = layout.cu_seqlens, layout.start_pos

    lo, hi = dt_limit
    BLOCK_L = triton.next_power_of_2(L)
    BLOCK_H = max(1, min(triton.next_power_of_2(H), 4096 // BLOCK_L))
    # fmt: off
    _chunk_cumsum_kernel[(S * Cn, triton.cdiv(H, BLOCK_H))](
        dt, dt_bias, A, cu, start_pos, dt_chunk, dA_cs,
        dt.stride(0), dt.stride(1),
        H, L, Cn, float(lo), float(hi),
        HAS_LIMIT=lo > 0.0 or hi != float("inf"), BLOCK_L=BLOCK_L, BLOCK_H=BLOCK_H,
    )
    # fmt: on

    precision = dot_precision(x.dtype)
    # Hand-picked tiles (no autotune): every tl.dot dim >= 16; dstate is held whole.
    BLOCK_N = _pow2_at_least_16(N)
    BLOCK_K = min(64, _pow2_at_least_16(L))
    BLOCK_P = min(64, _pow2_at_least_16(P))
    state_n = min(BLOCK_N, 64)
    grid = (S * Cn, H, triton.cdiv(P, BLOCK_P) * triton.cdiv(N, state_n))
    # fmt: off
    _chunk_state_kernel[grid](
        x, B, dt_chunk, dA_cs, cu, start_pos, chunk_states,
        x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        H, P, N, L, Cn, H // G,
        BLOCK_K=BLOCK_K, BLOCK_P=BLOCK_P, BLOCK_N=state_n, DOT_PRECISION=precision, num_warps=4,
    )
    # fmt: on

    BLOCK = min(2048, triton.next_power_of_2(P * N))
    # fmt: off
    _state_passing_kernel[(S, H, triton.cdiv(P * N, BLOCK))](
        chunk_states, initial_states, final_states, dA_cs, cu, start_pos,
        *initial_states.stride(),
        H, P, N, L, Cn,
        BLOCK=BLOCK, num_warps=4,
    )
    # fmt: on

    # Nano-9B-v2 (chunk 128, headdim 80, dstate 128): a whole chunk per program, headdim in two
    # blocks of 64, keys in steps of 32, 8 warps -> 209 registers, no spills on sm_90 (ptxas -v;
    # keys in steps of 64 or 4 warps spill).
    BLOCK_M = min(128, _pow2_at_least_16(L))
    BLOCK_K = min(32, BLOCK_M)
    grid = (S * Cn, H, triton.cdiv(L, BLOCK_M) * triton.cdiv(P, BLOCK_P))
    # fmt: off
    _chunk_scan_kernel[grid](
        x, B, C, D, dt_chunk, dA_cs, cu, start_pos, chunk_states, initial_states, y,
        x.stride(0), x.stride(1), x.stride(2),
        B.stride(0), B.stride(1), B.stride(2),
        C.stride(0), C.stride(1), C.stride(2),
        *initial_states.stride(),
        y.stride(0), y.stride(1), y.stride(2),
        H, P, N, L, Cn, H // G,
        BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, DOT_PRECISION=precision,
        num_warps=8 if BLOCK_M * BLOCK_N >= 8192 else 4,  # C_m is M x dstate
    )
    # fmt: on
    return SSDOutput(y=y, final_states=final_states, chunk_states=chunk_states)
