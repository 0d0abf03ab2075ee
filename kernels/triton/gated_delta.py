"""Gated delta rule, Triton path (semantics and the chunked algebra: kernels/gated_delta.py).

Prefill runs four launches over the logical chunk grid of kernels/triton/ssd.py (chunk c of
sequence s covers absolute positions [(start_pos[s] // L + c) * L, + L); slots outside the
sequence are empty: q = k = v = 0, g = beta = 0, exact no-ops):

    1. _l2norm_kernel      qn = l2norm(q) / sqrt(dk), kn = l2norm(k), float32, per key head
    2. _chunk_prep_kernel  per (chunk, v head): cum = cumsum(g); A = strict_lower(beta kn kn^T o
                           Gamma); T = (I + A)^-1 by forward substitution in registers;
                           U = T diag(beta) V, W = T diag(beta exp(cum)) K      (float32 scratch)
    3. _state_kernel       per (sequence, v head, block of v columns), chunk after chunk:
                           V' = U - W S (written over U); S <- exp(cum_L) S + (exp(cum_L - cum) K)^T V';
                           the state after every chunk into chunk_states, the last into final
    4. _output_kernel      per (chunk, v head, v block): O = diag(exp(cum)) Q S_prev + (Q K^T o
                           Gamma) V', S_prev = the initial state or the state after chunk c-1

Decode is one launch, _decode_kernel, per (request, v head, v block), in place on its pool slot
(rows of slot 0 are padding: no read, no write, o = 0). Every load is upcast to float32 at once;
all accumulation is float32; tl.dot on float32 operands is IEEE for float32 models and TF32
otherwise (baton.kernels.backend.dot_precision). No autotune: the decode kernel writes state in place,
and the hand-picked tiles keep every tl.dot dimension >= 16.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.backend import dot_precision
from baton.kernels.gated_delta import L2NORM_EPS, GatedDeltaOutput, _check_shapes
from baton.kernels.layouts import ChunkLayout
from baton.kernels.triton.ssd import _chunk_coords


# fmt: off
@triton.jit
def _l2norm_kernel(
    q_ptr, k_ptr, qn_ptr, kn_ptr,
    stride_q_t, stride_q_h, stride_q_d, stride_k_t, stride_k_h, stride_k_d,
    rows, Hk, dk, scale, eps,
    BLOCK_R: tl.constexpr, BLOCK_DK: tl.constexpr,
):
    # fmt: on
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # flat (token, key head)
    d = tl.arange(0, BLOCK_DK)
    mask = (r < rows)[:, None] & (d < dk)[None, :]
    t, h = (r // Hk).to(tl.int64), r % Hk
    q = tl.load(q_ptr + (t * stride_q_t + h * stride_q_h)[:, None] + d[None, :] * stride_q_d,
                mask=mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + (t * stride_k_t + h * stride_k_h)[:, None] + d[None, :] * stride_k_d,
                mask=mask, other=0.0).to(tl.float32)
    q = q * (scale / tl.sqrt(tl.sum(q * q, axis=1) + eps))[:, None]
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=1) + eps))[:, None]
    out = r.to(tl.int64)[:, None] * dk + d[None, :]
    tl.store(qn_ptr + out, q, mask=mask)
    tl.store(kn_ptr + out, k, mask=mask)


@triton.jit
def _chunk_slots(cu_ptr, start_pos_ptr, s, c, L, BLOCK_L: tl.constexpr):
    """Slot indices l of chunk c of sequence s, their packed tokens and whether they hold one."""
    tok0, seq_len, offset = _chunk_coords(cu_ptr, start_pos_ptr, s, L)
    l = tl.arange(0, BLOCK_L)
    local = c * L + l - offset
    valid = (l < L) & (local >= 0) & (local < seq_len)
    return l, tok0 + local, valid, seq_len, offset


# fmt: off
@triton.jit
def _chunk_prep_kernel(
    kn_ptr, v_ptr, g_ptr, beta_ptr, cu_ptr, start_pos_ptr, chunk_base_ptr, cum_ptr, w_ptr, u_ptr,
    stride_v_t, stride_v_h, stride_v_d, stride_g_t, stride_g_h, stride_b_t, stride_b_h,
    Hk, Hv, dk, dv, L, num_chunks,
    BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    sc = tl.program_id(0).to(tl.int64)
    s, c = sc // num_chunks, sc % num_chunks
    h = tl.program_id(1)
    hk = h // (Hv // Hk)
    l, tok, valid, seq_len, offset = _chunk_slots(cu_ptr, start_pos_ptr, s, c, L, BLOCK_L)
    if c * L >= offset + seq_len:  # past this sequence's last chunk
        return
    chunk = tl.load(chunk_base_ptr + s) + c  # index among the batch's real chunks
    g = tl.load(g_ptr + tok * stride_g_t + h * stride_g_h, mask=valid, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + tok * stride_b_t + h * stride_b_h, mask=valid, other=0.0)
    beta = beta.to(tl.float32)
    cum = tl.cumsum(g, axis=0)
    row = (chunk * Hv + h) * L  # (chunks, Hv, L) rows of the scratch buffers
    tl.store(cum_ptr + row + l, cum, mask=l < L)

    kk = tl.zeros((BLOCK_L, BLOCK_L), dtype=tl.float32)
    for k0 in range(0, dk, BLOCK_K):
        d = k0 + tl.arange(0, BLOCK_K)
        kb = tl.load(kn_ptr + (tok * Hk + hk)[:, None] * dk + d[None, :],
                     mask=valid[:, None] & (d < dk)[None, :], other=0.0)
        kk += tl.dot(kb, tl.trans(kb), input_precision=DOT_PRECISION)
    i, j = l[:, None], l[None, :]
    diff = tl.where(j <= i, cum[:, None] - cum[None, :], 0.0)
    A = tl.where(j < i, kk * beta[:, None] * tl.exp(diff), 0.0)

    # T = (I + A)^-1, A strictly lower: row i of T is e_i - sum_{j < i} A[i, j] T[j, :], and the
    # rows j >= i of the running T are still identity rows, which A[i, j] = 0 leaves out.
    T = tl.where(i == j, 1.0, 0.0)
    for r in range(1, BLOCK_L):
        a_r = tl.sum(tl.where(i == r, A, 0.0), axis=0)  # A[r, :] along the column axis
        t_r = tl.sum(a_r[:, None] * T, axis=0)
        T = tl.where(i == r, T - t_r[None, :], T)

    for k0 in range(0, dk, BLOCK_K):
        d = k0 + tl.arange(0, BLOCK_K)
        kb = tl.load(kn_ptr + (tok * Hk + hk)[:, None] * dk + d[None, :],
                     mask=valid[:, None] & (d < dk)[None, :], other=0.0)
        wb = tl.dot(T, kb * (beta * tl.exp(cum))[:, None], input_precision=DOT_PRECISION)
        tl.store(w_ptr + (row + l)[:, None] * dk + d[None, :], wb,
                 mask=(l < L)[:, None] & (d < dk)[None, :])
    for v0 in range(0, dv, BLOCK_V):
        e = v0 + tl.arange(0, BLOCK_V)
        vb = tl.load(v_ptr + tok[:, None] * stride_v_t + h * stride_v_h + e[None, :] * stride_v_d,
                     mask=valid[:, None] & (e < dv)[None, :], other=0.0).to(tl.float32)
        ub = tl.dot(T, vb * beta[:, None], input_precision=DOT_PRECISION)
        tl.store(u_ptr + (row + l)[:, None] * dv + e[None, :], ub,
                 mask=(l < L)[:, None] & (e < dv)[None, :])


# fmt: off
@triton.jit
def _state_kernel(
    kn_ptr, cum_ptr, w_ptr, u_ptr, init_ptr, states_ptr, final_ptr, cu_ptr, start_pos_ptr,
    chunk_base_ptr,
    stride_init_s, stride_init_h, stride_init_k, stride_init_v,
    Hk, Hv, dk, dv, L,
    BLOCK_L: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // (Hv // Hk)
    e = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    d = tl.arange(0, BLOCK_DK)
    tile_mask = (d < dk)[:, None] & (e < dv)[None, :]
    state = tl.load(
        init_ptr + s * stride_init_s + h * stride_init_h
        + d[:, None] * stride_init_k + e[None, :] * stride_init_v,
        mask=tile_mask, other=0.0,
    ).to(tl.float32)
    _, seq_len, offset = _chunk_coords(cu_ptr, start_pos_ptr, s, L)
    base = tl.load(chunk_base_ptr + s)
    for c in range(0, tl.cdiv(offset + seq_len, L)):
        l, tok, valid, _, _ = _chunk_slots(cu_ptr, start_pos_ptr, s, c, L, BLOCK_L)
        row = ((base + c) * Hv + h) * L
        lk_mask = (l < L)[:, None] & (d < dk)[None, :]
        lv_mask = (l < L)[:, None] & (e < dv)[None, :]
        w = tl.load(w_ptr + (row + l)[:, None] * dk + d[None, :], mask=lk_mask, other=0.0)
        u_at = u_ptr + (row + l)[:, None] * dv + e[None, :]
        v_new = tl.load(u_at, mask=lv_mask, other=0.0)
        v_new -= tl.dot(w, state, input_precision=DOT_PRECISION)
        tl.store(u_at, v_new, mask=lv_mask)  # V' replaces U (this program's block only)
        cum = tl.load(cum_ptr + row + l, mask=l < L, other=0.0)
        cum_last = tl.load(cum_ptr + row + L - 1)
        kb = tl.load(kn_ptr + (tok * Hk + hk)[:, None] * dk + d[None, :],
                     mask=valid[:, None] & (d < dk)[None, :], other=0.0)
        k_dec = kb * tl.exp(cum_last - cum)[:, None]
        state = state * tl.exp(cum_last) + tl.dot(
            tl.trans(k_dec), v_new, input_precision=DOT_PRECISION
        )
        tile = ((base + c) * Hv + h) * dk * dv + d[:, None] * dv + e[None, :]
        tl.store(states_ptr + tile, state, mask=tile_mask)
    tl.store(final_ptr + (s * Hv + h) * dk * dv + d[:, None] * dv + e[None, :], state,
             mask=tile_mask)


# fmt: off
@triton.jit
def _output_kernel(
    qn_ptr, kn_ptr, cum_ptr, u_ptr, init_ptr, states_ptr, o_ptr, cu_ptr, start_pos_ptr,
    chunk_base_ptr,
    stride_init_s, stride_init_h, stride_init_k, stride_init_v,
    stride_o_t, stride_o_h, stride_o_d,
    Hk, Hv, dk, dv, L, num_chunks,
    BLOCK_L: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    sc = tl.program_id(0).to(tl.int64)
    s, c = sc // num_chunks, sc % num_chunks
    h = tl.program_id(1)
    hk = h // (Hv // Hk)
    l, tok, valid, seq_len, offset = _chunk_slots(cu_ptr, start_pos_ptr, s, c, L, BLOCK_L)
    if c * L >= offset + seq_len:
        return
    chunk = tl.load(chunk_base_ptr + s) + c
    e = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    row = (chunk * Hv + h) * L
    cum = tl.load(cum_ptr + row + l, mask=l < L, other=0.0)
    qk = tl.zeros((BLOCK_L, BLOCK_L), dtype=tl.float32)
    acc = tl.zeros((BLOCK_L, BLOCK_V), dtype=tl.float32)
    # The state entering the chunk: the initial state for chunk 0, else the state after c-1
    # (limits rather than `mask & scalar_bool`, which the interpreter mistypes).
    init_rows = tl.where(c == 0, dk, 0)
    prev_rows = tl.where(c > 0, dk, 0)
    for k0 in range(0, dk, BLOCK_K):
        d = k0 + tl.arange(0, BLOCK_K)
        lk_mask = valid[:, None] & (d < dk)[None, :]
        qb = tl.load(qn_ptr + (tok * Hk + hk)[:, None] * dk + d[None, :], mask=lk_mask, other=0.0)
        kb = tl.load(kn_ptr + (tok * Hk + hk)[:, None] * dk + d[None, :], mask=lk_mask, other=0.0)
        qk += tl.dot(qb, tl.trans(kb), input_precision=DOT_PRECISION)
        from_init = tl.load(
            init_ptr + s * stride_init_s + h * stride_init_h
            + d[:, None] * stride_init_k + e[None, :] * stride_init_v,
            mask=(d < init_rows)[:, None] & (e < dv)[None, :], other=0.0,
        ).to(tl.float32)
        prev = ((chunk - 1) * Hv + h) * dk * dv + d[:, None] * dv + e[None, :]
        from_prev = tl.load(states_ptr + prev, mask=(d < prev_rows)[:, None] & (e < dv)[None, :],
                            other=0.0)
        acc += tl.dot(qb * tl.exp(cum)[:, None], from_init + from_prev,
                      input_precision=DOT_PRECISION)
    i, j = l[:, None], l[None, :]
    gamma = tl.where(j <= i, tl.exp(tl.where(j <= i, cum[:, None] - cum[None, :], 0.0)), 0.0)
    v_new = tl.load(u_ptr + (row + l)[:, None] * dv + e[None, :],
                    mask=(l < L)[:, None] & (e < dv)[None, :], other=0.0)
    acc += tl.dot(qk * gamma, v_new, input_precision=DOT_PRECISION)
    tl.store(o_ptr + tok[:, None] * stride_o_t + h * stride_o_h + e[None, :] * stride_o_d,
             acc.to(o_ptr.dtype.element_ty), mask=valid[:, None] & (e < dv)[None, :])


# fmt: off
@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, pool_ptr, slots_ptr, o_ptr,
    stride_q_b, stride_q_h, stride_q_d, stride_k_b, stride_k_h, stride_k_d,
    stride_v_b, stride_v_h, stride_v_d, stride_g_b, stride_g_h, stride_beta_b, stride_beta_h,
    stride_pool_s, stride_pool_h, stride_pool_k, stride_pool_v,
    stride_o_b, stride_o_h, stride_o_d,
    Hk, Hv, dk, dv, scale, eps,
    BLOCK_DK: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # fmt: on
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    hk = h // (Hv // Hk)
    e = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    e_ok = e < dv
    o_at = o_ptr + b * stride_o_b + h * stride_o_h + e * stride_o_d
    slot = tl.load(slots_ptr + b).to(tl.int64)
    if slot == 0:  # padding row
        tl.store(o_at, tl.zeros((BLOCK_V,), dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=e_ok)
        return
    d = tl.arange(0, BLOCK_DK)
    d_ok = d < dk
    q = tl.load(q_ptr + b * stride_q_b + hk * stride_q_h + d * stride_q_d, mask=d_ok, other=0.0)
    k = tl.load(k_ptr + b * stride_k_b + hk * stride_k_h + d * stride_k_d, mask=d_ok, other=0.0)
    q, k = q.to(tl.float32), k.to(tl.float32)
    q = q * (scale / tl.sqrt(tl.sum(q * q, axis=0) + eps))
    k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + eps))
    v = tl.load(v_ptr + b * stride_v_b + h * stride_v_h + e * stride_v_d, mask=e_ok, other=0.0)
    decay = tl.exp(tl.load(g_ptr + b * stride_g_b + h * stride_g_h).to(tl.float32))
    beta = tl.load(beta_ptr + b * stride_beta_b + h * stride_beta_h).to(tl.float32)
    tile_mask = d_ok[:, None] & e_ok[None, :]
    tile = (pool_ptr + slot * stride_pool_s + h * stride_pool_h
            + d[:, None] * stride_pool_k + e[None, :] * stride_pool_v)
    state = tl.load(tile, mask=tile_mask, other=0.0).to(tl.float32) * decay
    tl.debug_barrier()  # every thread has read the block before any thread rewrites it
    delta = (v.to(tl.float32) - tl.sum(k[:, None] * state, axis=0)) * beta
    state += k[:, None] * delta[None, :]
    tl.store(tile, state.to(pool_ptr.dtype.element_ty), mask=tile_mask)
    tl.store(o_at, tl.sum(q[:, None] * state, axis=0).to(o_ptr.dtype.element_ty), mask=e_ok)


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def chunk_gated_delta_rule_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
    want_chunk_states: bool = True,
) -> GatedDeltaOutput:
    """Same contract as baton.kernels.gated_delta.chunk_gated_delta_rule: q, k (num_tokens,
    num_k_heads, k_head_dim), v (num_tokens, num_v_heads, v_head_dim) float32/float16/bfloat16,
    any strides; g, beta (num_tokens, num_v_heads) any float dtype and strides; initial_states
    (num_seqs, num_v_heads, k_head_dim, v_head_dim) any float dtype (float32 expected); layout:
    num_seqs, num_chunks, chunk_size, cu_seqlens (num_seqs + 1,) int32 and start_pos
    (num_seqs,) int64 only. Returns o in v's dtype and float32 final and chunk states (None
    when not wanted: the (num_seqs, num_chunks) gather is then skipped).

    The scratch buffers and the states after each chunk are kept per *real* chunk (at most
    num_tokens // chunk + 2 num_seqs of them, a bound known on the host), not per (sequence,
    num_chunks of the longest): one long prompt batched with many short ones would otherwise
    pay num_seqs times its chunk count in memory."""
    _check_shapes(q, k, v, g, beta, tuple(initial_states.shape), "chunk_gated_delta_rule")
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    S, Cn, L = layout.num_seqs, layout.num_chunks, layout.chunk_size
    if initial_states.shape[0] != S or layout.cu_seqlens.shape != (S + 1,):
        raise ValueError(f"initial_states and layout.cu_seqlens must cover {S} sequences")
    devices = {t.device for t in (q, k, v, g, beta, initial_states, layout.cu_seqlens)}
    if len(devices) != 1:
        raise ValueError(f"chunk_gated_delta_rule: tensors on several devices: {devices}")
    device = v.device
    o = torch.empty(T, Hv, dv, device=device, dtype=v.dtype)
    final = torch.empty(S, Hv, dk, dv, device=device, dtype=torch.float32)
    if S == 0:
        chunk_states = torch.empty(0, Cn, Hv, dk, dv, device=device) if want_chunk_states else None
        return GatedDeltaOutput(o=o, final_states=final, chunk_states=chunk_states)
    cu, start_pos = layout.cu_seqlens, layout.start_pos
    # Real chunks per sequence and where each sequence's first one sits among all of them
    # (device arithmetic: no host sync).
    seq_chunks = (start_pos % L + (cu[1:] - cu[:-1]) + L - 1) // L
    chunk_base = torch.zeros(S + 1, dtype=torch.int64, device=device)
    chunk_base[1:] = torch.cumsum(seq_chunks, 0)
    max_chunks = T // L + 2 * S  # ceil((offset + n) / L) <= n / L + 2 per sequence
    f32 = dict(device=device, dtype=torch.float32)
    qn, kn = torch.empty(T, Hk, dk, **f32), torch.empty(T, Hk, dk, **f32)
    cum = torch.empty(max_chunks, Hv, L, **f32)
    w, u = torch.empty(max_chunks, Hv, L, dk, **f32), torch.empty(max_chunks, Hv, L, dv, **f32)
    states = torch.empty(max_chunks, Hv, dk, dv, **f32)  # after each real chunk
    precision = dot_precision(v.dtype)
    # Chunk-sized tiles (L x L, L x 64, dk x v block): 8 warps keep them in registers at
    # Qwen3-Next's shapes (chunk 64, head dims 128), 4 spill or saturate 255 registers.
    warps = 8 if _pow2_at_least_16(L) * _pow2_at_least_16(max(dk, dv)) >= 8192 else 4

    BLOCK_DK = triton.next_power_of_2(dk)
    BLOCK_R = max(1, 4096 // BLOCK_DK)
    # fmt: off
    _l2norm_kernel[(triton.cdiv(T * Hk, BLOCK_R),)](
        q, k, qn, kn, *q.stride(), *k.stride(), T * Hk, Hk, dk, dk**-0.5, L2NORM_EPS,
        BLOCK_R=BLOCK_R, BLOCK_DK=BLOCK_DK,
    )
    # fmt: on
    # Hand-picked tiles: the whole chunk per program, head dims in blocks of 64.
    BLOCK_L = _pow2_at_least_16(L)
    BLOCK_K = min(64, _pow2_at_least_16(dk))
    BLOCK_V = min(64, _pow2_at_least_16(dv))
    # fmt: off
    _chunk_prep_kernel[(S * Cn, Hv)](
        kn, v, g, beta, cu, start_pos, chunk_base, cum, w, u,
        *v.stride(), *g.stride(), *beta.stride(),
        Hk, Hv, dk, dv, L, Cn,
        BLOCK_L=BLOCK_L, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, DOT_PRECISION=precision,
        num_warps=warps,
    )
    # The state tile holds the whole k_head_dim: narrower v blocks as it grows (dk 128: 32
    # columns; 64 spilled at 8 warps). One pipeline stage: the loop carries the state anyway.
    state_v = min(_pow2_at_least_16(dv), max(16, 4096 // _pow2_at_least_16(dk)))
    _state_kernel[(S, Hv, triton.cdiv(dv, state_v))](
        kn, cum, w, u, initial_states, states, final, cu, start_pos, chunk_base,
        *initial_states.stride(),
        Hk, Hv, dk, dv, L,
        BLOCK_L=BLOCK_L, BLOCK_DK=_pow2_at_least_16(dk), BLOCK_V=state_v,
        DOT_PRECISION=precision, num_warps=warps, num_stages=1,
    )
    _output_kernel[(S * Cn, Hv, triton.cdiv(dv, BLOCK_V))](
        qn, kn, cum, u, initial_states, states, o, cu, start_pos, chunk_base,
        *initial_states.stride(), *o.stride(),
        Hk, Hv, dk, dv, L, Cn,
        BLOCK_L=BLOCK_L, BLOCK_K=BLOCK_K, BLOCK_V=BLOCK_V, DOT_PRECISION=precision,
        num_warps=warps, num_stages=2,
    )
    # fmt: on
    chunk_states = None
    if want_chunk_states:
        # chunk c of sequence s, or its last chunk for c past its end (which holds its final
        # state, as the torch path's no-op padding leaves it)
        c = torch.arange(Cn, device=device)
        last = (seq_chunks - 1)[:, None]
        chunk_states = states[chunk_base[:-1, None] + torch.minimum(c[None, :], last)]
    return GatedDeltaOutput(o=o, final_states=final, chunk_states=chunk_states)


def gated_delta_decode_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Same contract as baton.kernels.gated_delta.gated_delta_decode: q, k (batch, num_k_heads,
    k_head_dim), v (batch, num_v_heads, v_head_dim), g, beta (batch, num_v_heads), any float
    dtypes and strides; state_pool (num_slots, num_v_heads, k_head_dim, v_head_dim) any float
    dtype and strides, updated in place; state_indices (batch,) int, 0 = padding row.
    Returns o (batch, num_v_heads, v_head_dim) in v's dtype."""
    _check_shapes(q, k, v, g, beta, tuple(state_pool.shape), "gated_delta_decode")
    batch, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    if state_indices.shape != (batch,):
        raise ValueError(f"state_indices must be ({batch},), got {tuple(state_indices.shape)}")
    o = torch.empty(batch, Hv, dv, device=v.device, dtype=v.dtype)
    if batch == 0:
        return o
    BLOCK_DK = triton.next_power_of_2(dk)
    BLOCK_V = min(triton.next_power_of_2(dv), max(16, 4096 // BLOCK_DK))
    # fmt: off
    _decode_kernel[(batch, Hv, triton.cdiv(dv, BLOCK_V))](
        q, k, v, g, beta, state_pool, state_indices, o,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *state_pool.stride(),
        *o.stride(),
        Hk, Hv, dk, dv, dk**-0.5, L2NORM_EPS,
        BLOCK_DK=BLOCK_DK, BLOCK_V=BLOCK_V, num_warps=4,
    )
    # fmt: on
    return o
