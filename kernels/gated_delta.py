"""Gated delta rule (gated DeltaNet: Qwen3-Next, Qwen3.5, OLMo-Hybrid) over pool slots, torch path.

Per value head, with a state S of shape (k_head_dim, v_head_dim) (transformers' layout: its
recurrent state is (batch, num_v_heads, k_head_dim, v_head_dim), and so is a pool slot here):

    q, k  <- l2norm(q), l2norm(k)          (float32, x * rsqrt(sum x^2 + 1e-6), as transformers'
                                            use_qk_l2norm_in_kernel=True, which every family passes)
    q     <- q / sqrt(k_head_dim)
    S     <- exp(g_t) S                    (g: per-head log decay, <= 0)
    S     <- S + k_t (beta_t (v_t - k_t^T S))^T
    o_t    = q_t^T S                       (v_head_dim,)

Query/key heads serve num_v_heads / num_k_heads consecutive value heads each (repeat_interleave,
as transformers does). All arithmetic is float32; o comes back in v's dtype. These are the
semantics of transformers 5.x's `torch_recurrent_gated_delta_rule` and
`torch_chunk_gated_delta_rule` (tests/test_gated_delta.py compares against both).

Prefill uses the chunked form on the same per-sequence, absolute-position chunk grid as the SSD
scan (kernels/ssd.py: `build_chunk_layout`): a sequence resumed at position 100 with chunk 64
starts with a 28-token chunk, so every chunk-end state is a true state at a multiple of the chunk
size (prefix-cache checkpoints). Empty slots get q = k = v = 0, beta = 0 and g = 0: decay 1 and
no write (k = 0), so padding never changes a state or an output. Per chunk of L tokens with
cum = cumsum(g) inside the chunk, Gamma[i, j] = exp(cum_i - cum_j) for j <= i:

    A      = strict_lower(diag(beta) K K^T o Gamma)
    U      = (I + A)^-1 diag(beta) V                      (the delta rule's corrections)
    W      = (I + A)^-1 diag(beta exp(cum)) K
    V'     = U - W S                                      (S: the state entering the chunk)
    O      = diag(exp(cum)) Q S + (Q K^T o Gamma) V'       (Gamma's lower triangle, diagonal too)
    S     <- exp(cum_last) S + (diag(exp(cum_last - cum)) K)^T V'

Everything but the last three lines is batched over every (sequence, head, chunk); the loop runs
over chunks only, each step one batched matmul per line over (sequence, head).

Public functions dispatch like every kernel (kernels/backend.py): CUDA tensors -> Triton
(kernels/triton/gated_delta.py), CPU tensors -> the C kernels (kernels/cpu/gated_delta.c) when
built and the pool is contiguous float32, else the torch path here; BATON_KERNELS=torch|triton
forces a side, BATON_CPU_OPS=0 turns the C kernels off.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu import gated_delta as cpu_gated_delta
from baton.kernels.layouts import ChunkLayout
from baton.kernels.workspace import scratch

L2NORM_EPS = 1e-6  # transformers' (and FLA's) l2norm eps inside the kernel


class GatedDeltaOutput(NamedTuple):
    o: torch.Tensor  # (num_tokens, num_v_heads, v_head_dim), v's dtype
    final_states: torch.Tensor  # (num_seqs, num_v_heads, k_head_dim, v_head_dim) float32
    # (num_seqs, num_chunks, num_v_heads, k_head_dim, v_head_dim) float32, after each chunk;
    # None only from the Triton launcher asked not to gather them (gated_delta_prefill)
    chunk_states: torch.Tensor | None


def gdn_gating(
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    beta_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-head decay and write strength from the projections, as transformers computes them.

    a, b: (..., num_v_heads) projection outputs (model dtype); A_log, dt_bias: (num_v_heads,).
    beta_scale: 2.0 for OLMo-Hybrid's `linear_allow_neg_eigval`, else 1.0.
    Returns g = -exp(A_log) * softplus(a + dt_bias) (float32) and beta = sigmoid(b) * beta_scale
    (computed in b's dtype, as the model does, returned as float32)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = b.sigmoid()
    if beta_scale != 1.0:
        beta = beta * beta_scale
    return g, beta.float()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x: (..., d) -> float32 x * rsqrt(sum(x^2) + 1e-6) over the last dim."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _check_shapes(q, k, v, g, beta, states_shape: tuple[int, ...], what: str) -> None:
    lead, (Hk, dk) = q.shape[:-2], q.shape[-2:]
    Hv, dv = v.shape[-2:]
    if k.shape != q.shape:
        raise ValueError(
            f"{what}: q and k must have one shape, got {tuple(q.shape)}, {tuple(k.shape)}"
        )
    if v.shape[:-2] != lead or g.shape != (*lead, Hv) or beta.shape != (*lead, Hv):
        raise ValueError(
            f"{what}: v must be {(*lead, Hv, dv)} and g, beta {(*lead, Hv)}, got "
            f"{tuple(v.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}"
        )
    if Hv % Hk:
        raise ValueError(f"{what}: num_v_heads {Hv} must be a multiple of num_k_heads {Hk}")
    if states_shape[-3:] != (Hv, dk, dv):
        raise ValueError(
            f"{what}: states must be (..., num_v_heads, k_head_dim, v_head_dim) = "
            f"(..., {Hv}, {dk}, {dv}), got {states_shape}"
        )


def _check_indices(state_indices: torch.Tensor, rows: int, what: str) -> None:
    if state_indices.shape != (rows,):
        raise ValueError(
            f"{what}: state_indices must hold one slot per row, ({rows},), "
            f"got {tuple(state_indices.shape)}"
        )


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
) -> GatedDeltaOutput:
    """Chunked gated delta rule of a packed varlen batch (CUDA -> Triton, else torch).

    q, k: (num_tokens, num_k_heads, k_head_dim) any float dtype (the conv output; normalised
    here); v: (num_tokens, num_v_heads, v_head_dim); g: (num_tokens, num_v_heads) log decay
    (float32 from `gdn_gating`); beta: (num_tokens, num_v_heads); initial_states: (num_seqs,
    num_v_heads, k_head_dim, v_head_dim), float32 expected (zeros for fresh sequences);
    layout: baton.kernels.ssd.build_chunk_layout(seq_lens, start_pos, chunk_size, device).
    Chunks past a sequence's end hold its final state in chunk_states."""
    if select_backend(v) == "triton":
        from baton.kernels.triton.gated_delta import chunk_gated_delta_rule_triton

        return chunk_gated_delta_rule_triton(q, k, v, g, beta, initial_states, layout)
    return chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_states, layout)


def chunk_gated_delta_rule_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
) -> GatedDeltaOutput:
    _check_shapes(q, k, v, g, beta, tuple(initial_states.shape), "chunk_gated_delta_rule")
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    R = Hv // Hk
    S, Cn, L = layout.num_seqs, layout.num_chunks, layout.chunk_size
    if initial_states.shape[0] != S:
        raise ValueError(f"initial_states has {initial_states.shape[0]} rows for {S} sequences")

    def to_chunks(t: torch.Tensor) -> torch.Tensor:
        """(T, heads, ...) -> (S, heads, Cn, L, ...) with zeros in empty slots."""
        padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])[layout.slot_token]
        padded = padded.view(S, Cn * L, *t.shape[1:]).movedim(1, 2)
        return padded.reshape(S, t.shape[1], Cn, L, *t.shape[2:])

    qc = to_chunks(l2norm(q) * dk**-0.5)  # (S, Hk, Cn, L, dk)
    kc = to_chunks(l2norm(k))
    vc = to_chunks(v.float())  # (S, Hv, Cn, L, dv)
    gc = to_chunks(g.float())  # (S, Hv, Cn, L); empty slots: 0
    bc = to_chunks(beta.float())

    cum = gc.cumsum(-1)
    lower = torch.ones(L, L, dtype=torch.bool, device=v.device).tril()
    # Gamma[i, j] = exp(cum_i - cum_j) on and below the diagonal (masked before the exp: above it
    # the difference is positive and may overflow).
    gamma = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, -torch.inf).exp()
    gamma = gamma.view(S, Hk, R, Cn, L, L)

    # K K^T and Q K^T per key head, shared by its R value heads.
    kk = (kc @ kc.transpose(-1, -2))[:, :, None]  # (S, Hk, 1, Cn, L, L)
    qk = (qc @ kc.transpose(-1, -2))[:, :, None]
    A = (kk * gamma * bc.view(S, Hk, R, Cn, L, 1)).view(S, Hv, Cn, L, L)
    attn = (qk * gamma).view(S, Hv, Cn, L, L)

    exp_cum = cum.exp()
    k_rep = kc.repeat_interleave(R, dim=1)  # (S, Hv, Cn, L, dk)
    rhs = torch.cat([vc * bc[..., None], k_rep * (bc * exp_cum)[..., None]], dim=-1)
    # X = (I + A)^-1 rhs. solve_triangular reads A's strictly lower triangle only (unit
    # diagonal); solving for the L x L inverse and multiplying took ~0.6x the time of solving
    # for the wide right-hand side directly (batched LAPACK trsm is slow on small systems).
    eye = torch.eye(L, dtype=torch.float32, device=v.device).expand_as(A)
    solved = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True) @ rhs
    U, W = solved[..., :dv], solved[..., dv:]

    q_dec = qc.repeat_interleave(R, dim=1) * exp_cum[..., None]  # (S, Hv, Cn, L, dk)
    k_dec = k_rep * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = exp_cum[..., -1, None, None]  # (S, Hv, Cn, 1, 1)

    state = initial_states.float().clone()  # (S, Hv, dk, dv)
    chunk_states = torch.empty(S, Cn, Hv, dk, dv, dtype=torch.float32, device=v.device)
    out = torch.empty(S, Hv, Cn, L, dv, dtype=torch.float32, device=v.device)
    for c in range(Cn):  # the recurrence across chunks; everything inside is batched
        v_new = U[:, :, c] - W[:, :, c] @ state
        out[:, :, c] = q_dec[:, :, c] @ state + attn[:, :, c] @ v_new
        state = state * chunk_decay[:, :, c] + k_dec[:, :, c].transpose(-1, -2) @ v_new
        chunk_states[:, c] = state
    o = out.permute(0, 2, 3, 1, 4).reshape(S * Cn * L, Hv, dv)[layout.token_slot]
    return GatedDeltaOutput(o=o.to(v.dtype), final_states=state, chunk_states=chunk_states)


def gated_delta_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    layout: ChunkLayout,
    want_chunk_states: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`chunk_gated_delta_rule` with the states in the pool: sequence s starts from
    `state_pool[state_indices[s]]` and its final state is written back there.

    state_pool: (num_slots, num_v_heads, k_head_dim, v_head_dim), float32 by default;
    state_indices: (num_seqs,) int64. Returns (o (num_tokens, num_v_heads, v_head_dim) in v's
    dtype, chunk_states (num_seqs, num_chunks, num_v_heads, k_head_dim, v_head_dim) float32 or
    None when not wanted). On the CPU the threaded C scan (kernels/cpu/gated_delta.c) runs when
    it is built and the pool is contiguous float32."""
    _check_shapes(q, k, v, g, beta, tuple(state_pool.shape), "gated_delta_prefill")
    _check_indices(state_indices, layout.num_seqs, "gated_delta_prefill")
    if cpu_gated_delta.supported(v, state_pool):
        return cpu_gated_delta.gated_delta_prefill_cpu(
            q, k, v, g, beta, state_pool, state_indices, layout, want_chunk_states
        )
    initial_states = state_pool[state_indices]
    if select_backend(v) == "triton":
        from baton.kernels.triton.gated_delta import chunk_gated_delta_rule_triton

        out = chunk_gated_delta_rule_triton(
            q, k, v, g, beta, initial_states, layout, want_chunk_states
        )
    else:
        out = chunk_gated_delta_rule_torch(q, k, v, g, beta, initial_states, layout)
    state_pool[state_indices] = out.final_states.to(state_pool.dtype)
    return out.o, out.chunk_states if want_chunk_states else None


def gated_delta_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One recurrent step per request, in place on the pool.

    q, k: (batch, num_k_heads, k_head_dim); v: (batch, num_v_heads, v_head_dim); g, beta:
    (batch, num_v_heads); state_pool: (num_slots, num_v_heads, k_head_dim, v_head_dim);
    state_indices: (batch,) int64. Rows whose index is 0 are padding: they read and write
    nothing (slot 0 included) and their output is zero. Returns o: (batch, num_v_heads,
    v_head_dim) in v's dtype. CUDA -> Triton; CPU -> the C step when built, else torch."""
    _check_shapes(q, k, v, g, beta, tuple(state_pool.shape), "gated_delta_decode")
    _check_indices(state_indices, q.shape[0], "gated_delta_decode")
    if select_backend(v) == "triton":
        from baton.kernels.triton.gated_delta import gated_delta_decode_triton

        return gated_delta_decode_triton(q, k, v, g, beta, state_pool, state_indices)
    if cpu_gated_delta.supported(v, state_pool):
        return cpu_gated_delta.gated_delta_decode_cpu(q, k, v, g, beta, state_pool, state_indices)
    return gated_delta_decode_torch(q, k, v, g, beta, state_pool, state_indices)


def gated_delta_decode_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    _check_shapes(q, k, v, g, beta, tuple(state_pool.shape), "gated_delta_decode")
    _check_indices(state_indices, q.shape[0], "gated_delta_decode")
    batch, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    R = Hv // Hk
    qn = (l2norm(q) * dk**-0.5).repeat_interleave(R, dim=1)  # (batch, Hv, dk)
    kn = l2norm(k).repeat_interleave(R, dim=1)
    state = scratch("gdn_state", (batch, Hv, dk, dv), torch.float32, v.device)
    if state_pool.dtype == torch.float32:
        torch.index_select(state_pool, 0, state_indices, out=state)
    else:
        state.copy_(state_pool.index_select(0, state_indices))
    # The C kernel's algebra: both reads of the state in one batched product, before the decay,
    #   kv = k^T S,  qs = q^T S;  delta = beta (v - e kv);  o = e qs + (q . k) delta;
    #   S <- e S + k delta^T
    # (separate vector-matrix products before and after the update read the states twice).
    # Padding rows (slot 0) get e = 1 and beta = 0: their slot is written back unchanged.
    live = (state_indices != 0).view(batch, 1)
    e = torch.where(live, g.float().exp(), 1.0)  # (batch, Hv)
    reads = torch.stack([kn, qn], dim=2).view(-1, 2, dk) @ state.view(-1, dk, dv)
    kv, qs = reads.view(batch, Hv, 2, dv).unbind(2)
    delta = (v.float() - e[..., None] * kv) * (beta.float() * live)[..., None]
    o = e[..., None] * qs + (qn * kn).sum(-1, keepdim=True) * delta
    o = torch.where(live[..., None], o, 0.0)  # whatever the dummy slot holds
    state.mul_(e.view(batch, Hv, 1, 1))
    # S += k delta^T in place (a batched rank-1 update; an outer-product temporary the size of
    # the states would cost more in page faults than the arithmetic).
    state.view(-1, dk, dv).baddbmm_(kn.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))
    state_pool.index_copy_(0, state_indices, state.to(state_pool.dtype))
    return o.to(v.dtype)
