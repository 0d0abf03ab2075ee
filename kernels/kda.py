"""Kimi Delta Attention (KDA: Kimi Linear, Bailing hybrid) over pool slots, torch path.

KDA is the gated delta rule (kernels/gated_delta.py) with a decay per *channel* of the key instead
of one per head. Per head, with a state S of shape (head_dim_k, head_dim_v) (transformers' layout:
its recurrent state is (batch, heads, dk, dv), and so is a pool slot here):

    q, k  <- l2norm(q), l2norm(k)          (float32, x / sqrt(sum x^2 + 1e-6): transformers' and
                                            FLA's `l2norm`, use_qk_l2norm_in_kernel=True)
    q     <- q / sqrt(dk)
    S     <- diag(exp(g_t)) S              (g: (dk,) log decay per key channel, <= 0)
    S     <- S + k_t (beta_t (v_t - k_t^T S))^T
    o_t    = q_t^T S                       (dv,)

These are the semantics of transformers 5.25's `recurrent_kimi_delta_attention` and
`chunk_kimi_delta_attention` (tests/test_kimi_kernels.py compares against a float64 oracle and
against both). All arithmetic is float32; o comes back in v's dtype.

Prefill runs the chunked form on the per-sequence, absolute-position chunk grid every recurrent
mixer shares (kernels/ssd.py: `build_chunk_layout`), so each chunk-end state is a true state at a
multiple of the chunk size (prefix checkpoints). Empty slots get q = k = v = 0, beta = 0, g = 0
(decay 1, no write). Per chunk of L tokens, cum = cumsum(g) over the chunk (L, dk), and
D[i, j, c] = exp(cum_i[c] - cum_j[c]) for j <= i:

    A      = strict_lower(diag(beta) (sum_c K_i K_j D[i, j]))
    U      = (I + A)^-1 diag(beta) V                    (the delta rule's corrections)
    W      = (I + A)^-1 diag(beta) (K o exp(cum))
    V'     = U - W S                                    (S: the state entering the chunk)
    O      = (Q o exp(cum)) S + lower(sum_c Q_i K_j D[i, j]) V'
    S     <- diag(exp(cum_last)) S + (K o exp(cum_last - cum))^T V'

Unlike GDN's scalar decay, D does not factor into a row and a column term without overflow risk
(exp(-cum_j) grows without bound), so the (L, L, dk) decay is built per chunk, masked before the
exp (as transformers does), and the loop runs over chunks with (sequence, head) batched inside.

On the CPU, prefill and decode run the C kernels (kernels/cpu/kda.c: the recurrence token by token
on an L1-resident block of the state, threaded over (sequence, head, column block), chunk-end
states copied out on the same grid) when they are built and the pool is contiguous float32, else
the torch path here; BATON_CPU_OPS=0 turns them off.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu import kda as cpu_kda
from baton.kernels.layouts import ChunkLayout

L2NORM_EPS = 1e-6  # transformers' (and FLA's) l2norm eps inside the kernel


class KDAOutput(NamedTuple):
    o: torch.Tensor  # (num_tokens, heads, dv), v's dtype
    final_states: torch.Tensor  # (num_seqs, heads, dk, dv) float32
    chunk_states: torch.Tensor  # (num_seqs, num_chunks, heads, dk, dv) float32, after each chunk


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    head_dim: int,
    lower_bound: float | None = None,
) -> torch.Tensor:
    """The per-channel log decay, as transformers computes it.

    f: (..., heads * dk) the decay projection's output (model dtype); A_log: (heads,);
    dt_bias: (heads * dk,). Returns (..., heads, dk) float32:
      lower_bound None: g = -exp(A_log) softplus(f + dt_bias) (KimiLinearForgetGate; softplus
                        is the identity above 20, as there)
      else:             g = lower_bound sigmoid(exp(A_log) (f + dt_bias)) (Bailing's safe gate,
                        rounded to f's dtype as BailingHybridForgetGate returns it)"""
    x = (f.float() + dt_bias.float()).unflatten(-1, (-1, head_dim))
    rate = A_log.float().exp()[:, None]
    if lower_bound is None:
        return -rate * F.softplus(x)
    return (lower_bound * torch.sigmoid(rate * x)).to(f.dtype).float()


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x: (..., d) -> float32 x / sqrt(sum(x^2) + 1e-6) over the last dim (transformers' form)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _check(q, k, v, g, beta, states_shape: tuple[int, ...], what: str) -> None:
    lead, (H, dk) = q.shape[:-2], q.shape[-2:]
    dv = v.shape[-1]
    if k.shape != q.shape or v.shape[:-1] != (*lead, H):
        raise ValueError(
            f"{what}: q, k must be (..., heads, dk) and v (..., heads, dv) alike, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if g.shape != q.shape or beta.shape != (*lead, H):
        raise ValueError(
            f"{what}: g must be {tuple(q.shape)} and beta {(*lead, H)}, got "
            f"{tuple(g.shape)}, {tuple(beta.shape)}"
        )
    if states_shape[-3:] != (H, dk, dv):
        raise ValueError(f"{what}: states must be (..., {H}, {dk}, {dv}), got {states_shape}")


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
) -> KDAOutput:
    """Chunked KDA of a packed varlen batch.

    q, k: (num_tokens, heads, dk) any float dtype (normalised here); v: (num_tokens, heads, dv);
    g: (num_tokens, heads, dk) float32 log decay (`kda_gate`); beta: (num_tokens, heads);
    initial_states: (num_seqs, heads, dk, dv) float32; layout: build_chunk_layout(seq_lens,
    start_pos, chunk_size, device). Chunks past a sequence's end hold its final state."""
    _check(q, k, v, g, beta, tuple(initial_states.shape), "chunk_kda")
    H, dk = q.shape[1:]
    dv = v.shape[-1]
    S, Cn, L = layout.num_seqs, layout.num_chunks, layout.chunk_size
    if initial_states.shape[0] != S:
        raise ValueError(f"initial_states has {initial_states.shape[0]} rows for {S} sequences")

    def to_chunks(t: torch.Tensor) -> torch.Tensor:
        """(T, H, ...) -> (S, H, Cn, L, ...) with zeros in empty slots."""
        padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])[layout.slot_token]
        padded = padded.view(S, Cn * L, *t.shape[1:]).movedim(1, 2)
        return padded.reshape(S, H, Cn, L, *t.shape[2:])

    qc = to_chunks(l2norm(q) * dk**-0.5)  # (S, H, Cn, L, dk)
    kc = to_chunks(l2norm(k))
    vc = to_chunks(v.float())  # (S, H, Cn, L, dv)
    bc = to_chunks(beta.float())  # (S, H, Cn, L)
    # float64 running sums: the decays are differences of them, and in float32 a sum of -1000
    # would carry exponent errors of ~1e-4 into every strongly decayed term
    cum = to_chunks(g.double()).cumsum(-2)  # (S, H, Cn, L, dk); empty slots add 0
    lower = torch.ones(L, L, dtype=torch.bool, device=v.device).tril()
    eye = torch.eye(L, dtype=torch.float32, device=v.device)

    state = initial_states.float().clone()  # (S, H, dk, dv)
    chunk_states = torch.empty(S, Cn, H, dk, dv, dtype=torch.float32, device=v.device)
    out = torch.empty(S, H, Cn, L, dv, dtype=torch.float32, device=v.device)
    for c in range(Cn):
        qi, ki, vi, bi, ci = qc[:, :, c], kc[:, :, c], vc[:, :, c], bc[:, :, c], cum[:, :, c]
        # D[i, j, :] = exp(cum_i - cum_j) on and below the diagonal, 0 above (masked first:
        # above it the difference is positive and may overflow)
        diff = (ci[..., :, None, :] - ci[..., None, :, :]).float()
        decay_ij = diff.masked_fill_(~lower[..., None], -torch.inf).exp_()
        kd = ki[..., None, :, :] * decay_ij  # (S, H, L_i, L_j, dk): k_j D[i, j]
        A = (ki[..., :, None, :] * kd).sum(-1) * bi[..., None]  # (S, H, L, L)
        attn = (qi[..., :, None, :] * kd).sum(-1)
        decay = ci.float().exp()
        rhs = torch.cat([vi * bi[..., None], ki * (bi[..., None] * decay)], dim=-1)
        # (I + A)^-1 reads A's strictly lower triangle only (unit diagonal)
        inverse = torch.linalg.solve_triangular(
            A, eye.expand_as(A), upper=False, unitriangular=True
        )
        solved = inverse @ rhs
        U, W = solved[..., :dv], solved[..., dv:]
        v_new = U - W @ state
        out[:, :, c] = (qi * decay) @ state + attn @ v_new
        last = ci[..., -1:, :]  # (S, H, 1, dk)
        to_end = (last - ci).float().exp()  # (S, H, L, dk)
        state = (
            state * last.float().transpose(-1, -2).exp() + (ki * to_end).transpose(-1, -2) @ v_new
        )
        chunk_states[:, c] = state
    o = out.permute(0, 2, 3, 1, 4).reshape(S * Cn * L, H, dv)[layout.token_slot]
    return KDAOutput(o=o.to(v.dtype), final_states=state, chunk_states=chunk_states)


def kda_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """KDA with the states in the pool: sequence s starts from `state_pool[state_indices[s]]`
    (num_slots, heads, dk, dv) and its final state is written back there. state_indices:
    (num_seqs,) int64. Returns (o (num_tokens, heads, dv) in v's dtype, chunk_states (num_seqs,
    num_chunks, heads, dk, dv) float32). CUDA: Triton (kernels/triton/kda.py); CPU: the C
    scan when supported, else torch."""
    _check(q, k, v, g, beta, tuple(state_pool.shape), "kda_prefill")
    if state_indices.shape != (layout.num_seqs,):
        raise ValueError(f"kda_prefill: one slot per sequence, got {tuple(state_indices.shape)}")
    if select_backend(v) == "triton":
        from baton.kernels.triton.kda import kda_prefill_triton

        return kda_prefill_triton(q, k, v, g, beta, state_pool, state_indices, layout)
    if cpu_kda.supported(v, state_pool):
        return cpu_kda.kda_prefill_cpu(q, k, v, g, beta, state_pool, state_indices, layout)
    out = chunk_kda_torch(q, k, v, g, beta, state_pool[state_indices], layout)
    state_pool[state_indices] = out.final_states.to(state_pool.dtype)
    return out.o, out.chunk_states


def kda_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """One recurrent step per request, in place on the pool.

    q, k: (batch, heads, dk); v: (batch, heads, dv); g: (batch, heads, dk) float32; beta:
    (batch, heads); state_pool: (num_slots, heads, dk, dv); state_indices: (batch,) int64.
    Rows whose index is 0 are padding: their slot is left as it was and their output is zero.
    Returns o: (batch, heads, dv) in v's dtype. CUDA: Triton; CPU: the C step when supported,
    else torch."""
    _check(q, k, v, g, beta, tuple(state_pool.shape), "kda_decode")
    if state_indices.shape != (q.shape[0],):
        raise ValueError(f"kda_decode: one slot per row, got {tuple(state_indices.shape)}")
    if select_backend(v) == "triton":
        from baton.kernels.triton.kda import kda_decode_triton

        return kda_decode_triton(q, k, v, g, beta, state_pool, state_indices)
    if cpu_kda.supported(v, state_pool):
        return cpu_kda.kda_decode_cpu(q, k, v, g, beta, state_pool, state_indices)
    return kda_decode_torch(q, k, v, g, beta, state_pool, state_indices)


def kda_decode_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    dk = q.shape[-1]
    live = (state_indices != 0)[:, None, None]  # (batch, 1, 1)
    qn, kn = l2norm(q) * dk**-0.5, l2norm(k)
    state = state_pool[state_indices].float()  # (batch, H, dk, dv)
    state = state * torch.where(live, g.float().exp(), 1.0)[..., None]
    kv = (kn[..., None] * state).sum(-2)  # (batch, H, dv)
    delta = (v.float() - kv) * (beta.float()[..., None] * live)
    state = state + kn[..., None] * delta[..., None, :]
    o = torch.where(live, (qn[..., None] * state).sum(-2), 0.0)
    state_pool.index_copy_(0, state_indices, state.to(state_pool.dtype))
    return o.to(v.dtype)
