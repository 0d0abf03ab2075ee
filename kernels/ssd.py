"""SSD (Mamba2 state-space duality) chunked scan over a packed varlen batch, torch path.

Chunks follow vLLM's logical-chunk rule: every chunk belongs to one sequence and is aligned to
the sequence's *absolute* position. A sequence resumed at position 100 with chunk size 64 starts
with a 28-token chunk, so the state at every chunk end is a true state of that sequence at a
multiple of the chunk size (what prefix-cache checkpoints need).

The torch path lays the packed tokens out as (num_seqs, num_chunks, chunk_size), placing token j
of sequence s at slot `start_pos[s] % chunk_size + j`. Empty slots get dt = 0, which makes them
exact no-ops for the recurrence (decay exp(0) = 1, input dt * x = 0), so padding at the front of
the first chunk and the back of the last chunk never changes a state. Then the whole scan is the
`ssd_minimal` algorithm: batched einsums, no loop over tokens.

      seq 0, start 100, 40 tokens, chunk 64:  |......[28 tok]|[12 tok]......|
      seq 1, start 0,   70 tokens:            |[64 tok]      |[6 tok].......|
                                               chunk 0         chunk 1
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.layouts import ChunkLayout, SSDOutput


def build_chunk_layout(
    seq_lens: list[int], start_pos: list[int], chunk_size: int, device: torch.device | str
) -> ChunkLayout:
    """seq_lens / start_pos: host lists, one entry per sequence (all lengths >= 1)."""
    num_seqs = len(seq_lens)
    offsets = [p % chunk_size for p in start_pos]
    num_chunks = max(
        ((o + n + chunk_size - 1) // chunk_size for o, n in zip(offsets, seq_lens)), default=0
    )
    span = num_chunks * chunk_size
    lens = torch.tensor(seq_lens, dtype=torch.int64)
    num_tokens = int(lens.sum())
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), lens)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    local = torch.arange(num_tokens) - cu[:-1][seq_of_token]
    token_slot = (
        seq_of_token * span + torch.tensor(offsets, dtype=torch.int64)[seq_of_token] + local
    )
    slot_token = torch.full((num_seqs * span,), num_tokens, dtype=torch.int64)
    slot_token[token_slot] = torch.arange(num_tokens)
    return ChunkLayout(
        num_seqs=num_seqs,
        num_chunks=num_chunks,
        chunk_size=chunk_size,
        token_slot=token_slot.to(device),
        slot_token=slot_token.to(device),
        cu_seqlens=cu.to(device=device, dtype=torch.int32),
        start_pos=torch.tensor(start_pos, dtype=torch.int64, device=device),
    )


def segsum(x: torch.Tensor) -> torch.Tensor:
    """x: (..., T) -> (..., T, T) with out[..., i, j] = sum(x[..., j+1:i+1]) for j <= i, else -inf."""
    T = x.shape[-1]
    x = x[..., None].expand(*x.shape, T)
    strict = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=-1)
    x = x.masked_fill(~strict, 0)
    out = torch.cumsum(x, dim=-2)
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=0)
    return out.masked_fill(~causal, -torch.inf)


def discretize_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """dt: (..., nheads) raw projection -> softplus(dt + dt_bias) limited to dt_limit, float32."""
    dt = F.softplus(dt.float() + dt_bias.float())
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = dt.clamp(min=lo, max=hi)
    return dt


def ssd_scan(
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
    """Chunked SSD scan of a packed varlen batch.

    x: (num_tokens, nheads, headdim); dt: (num_tokens, nheads) raw (before bias/softplus);
    A: (nheads,) float32 negative; B, C: (num_tokens, ngroups, dstate); D, dt_bias: (nheads,);
    initial_states: (num_seqs, nheads, headdim, dstate) float32 (zeros for fresh sequences).
    """
    if select_backend(x) == "triton":
        from baton.kernels.triton.ssd import ssd_scan_triton

        return ssd_scan_triton(x, dt, A, B, C, D, dt_bias, initial_states, layout, dt_limit)
    return ssd_scan_torch(x, dt, A, B, C, D, dt_bias, initial_states, layout, dt_limit)


def ssd_scan_torch(
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
    num_tokens, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    R = H // G
    S, Cn, L = layout.num_seqs, layout.num_chunks, layout.chunk_size

    def to_chunks(t: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])[layout.slot_token]
        return padded.view(S, Cn, L, *t.shape[1:])

    dt = discretize_dt(dt, dt_bias, dt_limit)  # (T, H)
    xc = to_chunks(x.float()).view(S, Cn, L, G, R, P)
    dtc = to_chunks(dt)  # (S, C, L, H); empty slots have dt = 0
    Bc = to_chunks(B.float())  # (S, C, L, G, N)
    Cc = to_chunks(C.float())
    xdt = xc * dtc.view(S, Cn, L, G, R, 1)

    dA = (dtc * A.float()).permute(0, 3, 1, 2).reshape(S, G, R, Cn, L)
    dA_cum = torch.cumsum(dA, dim=-1)  # (S, G, R, C, L)

    # 1. Within each chunk: y_diag[l] = sum_{s<=l} C_l . B_s * exp(sum_{s<k<=l} dA_k) * dt_s x_s
    decay = torch.exp(segsum(dA))  # (S, G, R, C, L, L)
    CB = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)  # (S, G, C, L, L)
    y_diag = torch.einsum("bgrcls,bcsgrp->bclgrp", decay * CB[:, :, None], xdt)

    # 2. State contributed by each chunk alone, decayed to the chunk end.
    decay_to_end = torch.exp(dA_cum[..., -1:] - dA_cum)  # (S, G, R, C, L)
    chunk_alone = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", Bc, decay_to_end, xdt)

    # 3. Pass states across chunks, starting from each sequence's initial state.
    states = torch.cat(
        [initial_states.float().view(S, 1, G, R, P, N), chunk_alone], dim=1
    )  # (S, C+1, G, R, P, N)
    chunk_decay = torch.exp(segsum(F.pad(dA_cum[..., -1], (1, 0))))  # (S, G, R, C+1, C+1)
    passed = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states)  # state before chunk z
    before_chunk, after_last = passed[:, :-1], passed[:, -1]

    # 4. Contribution of the state entering each chunk.
    y_off = torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", Cc, before_chunk, torch.exp(dA_cum))
    y = (y_diag + y_off).reshape(S * Cn * L, H, P)[layout.token_slot]
    y = y + x.float() * D.float().view(1, H, 1)
    return SSDOutput(
        y=y.to(x.dtype),
        final_states=after_last.reshape(S, H, P, N),
        chunk_states=passed[:, 1:].reshape(S, Cn, H, P, N),
    )


def ssd_scan_pool(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    layout: ChunkLayout,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    want_chunk_states: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`ssd_scan` with the states in the pool: sequence s starts from `ssm_pool[slots[s]]` and
    its final state is written back there. Returns (y, chunk_states or None); chunk_states as
    SSDOutput's, computed only when asked for (the C scan skips the copies otherwise).

    On the CPU the fused C scan (kernels/cpu/prefill.c) runs when it is built and the pool is
    contiguous float32; otherwise `ssd_scan` (torch or Triton) and a scatter into the pool."""
    from baton.kernels.cpu import prefill as cpu_prefill

    if cpu_prefill.supported(x, ssm_pool, layout.chunk_size):
        return cpu_prefill.ssd_prefill_cpu(
            x,
            discretize_dt(dt, dt_bias, dt_limit),
            A,
            B,
            C,
            D,
            ssm_pool,
            slots,
            layout.cu_seqlens,
            layout.start_pos,
            layout.chunk_size,
            layout.num_chunks if want_chunk_states else None,
        )
    out = ssd_scan(x, dt, A, B, C, D, dt_bias, ssm_pool[slots], layout, dt_limit)
    ssm_pool[slots] = out.final_states.to(ssm_pool.dtype)
    return out.y, out.chunk_states
