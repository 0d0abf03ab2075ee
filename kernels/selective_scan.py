"""Mamba1 selective scan: prefill over a packed varlen batch and the one-token decode update, both
with per-sequence states in pool slots, torch path.

Per channel d of the d_inner channels and state index n (A is per channel, unlike Mamba2's
scalar per head):

    delta_t = softplus(dt_t + dt_bias)                      (T, d_inner)
    h_t     = exp(delta_t * A) * h_{t-1} + (delta_t x_t) B_t   h: (d_inner, d_state)
    y_t     = h_t . C_t + D x_t,   times silu(z_t) when a gate z is given

ssm pool: (num_slots, d_inner, d_state), float32 by default; slot 0 is the dummy slot that padded
rows read and write.

Prefill follows the SSD scan's chunk grid (kernels/ssd.py, vLLM's logical-chunk rule): every
chunk belongs to one sequence and is aligned to its absolute position, so the state at each
chunk end is a true state of the sequence at a multiple of the chunk size, which is what a
prefix-cache checkpoint stores. For this recurrence the chunks only decide where those states
are emitted. Empty slots of the aligned layout get delta = 0: decay exp(0) = 1 and input 0, an
exact no-op.

The torch path steps through the aligned time axis, every sequence and channel at once. Mamba1
has no matrix form like SSD's (the decay differs per (channel, state) pair): a log-depth scan
would stream a (seqs, tokens, d_inner, d_state) tensor through memory log2(L) times, where the
step loop keeps one (seqs, d_inner, d_state) state in cache. The CPU engine runs the threaded C
scan (kernels/cpu/mamba1.c) and the GPU the Triton kernels (kernels/triton/selective_scan.py);
this path is their reference and the fallback. tests/oracles.py holds the per-sequence,
token-by-token oracle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu import mamba1 as cpu_mamba1
from baton.kernels.layouts import ChunkLayout, SelectiveScanOutput


def selective_scan(
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
    """Selective scan of a packed varlen batch.

    x: (num_tokens, d_inner); dt: (num_tokens, d_inner) raw (before bias and softplus);
    A: (d_inner, d_state) float32 negative; B, C: (num_tokens, d_state); D, dt_bias: (d_inner,);
    z: (num_tokens, d_inner) gate or None; initial_states: (num_seqs, d_inner, d_state) float32.
    """
    if select_backend(x) == "triton":
        from baton.kernels.triton.selective_scan import selective_scan_triton

        return selective_scan_triton(x, dt, A, B, C, D, dt_bias, z, initial_states, layout)
    return selective_scan_torch(x, dt, A, B, C, D, dt_bias, z, initial_states, layout)


def selective_scan_torch(
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
    num_tokens, width = x.shape
    S, Cn, L = layout.num_seqs, layout.num_chunks, layout.chunk_size
    span = Cn * L

    def aligned(t: torch.Tensor) -> torch.Tensor:  # (T, ...) -> (S, span, ...); empty slots 0
        padded = torch.cat([t, t.new_zeros(1, *t.shape[1:])])[layout.slot_token]
        return padded.view(S, span, *t.shape[1:])

    delta = aligned(F.softplus(dt.float() + dt_bias.float()))
    u = delta * aligned(x.float())
    Bs, Cs = aligned(B.float()), aligned(C.float())
    A = A.float()
    state = initial_states.float().clone()  # (S, d_inner, d_state)
    ys = torch.empty(S, span, width, dtype=torch.float32, device=x.device)
    chunk_states = torch.empty(S, Cn, *state.shape[1:], dtype=torch.float32, device=x.device)
    for j in range(span):
        state.mul_(torch.exp(delta[:, j, :, None] * A))
        state.addcmul_(u[:, j, :, None], Bs[:, j, None, :])
        ys[:, j] = torch.bmm(state, Cs[:, j, :, None]).squeeze(-1)
        if (j + 1) % L == 0:
            chunk_states[:, j // L] = state
    y = ys.view(S * span, width)[layout.token_slot] + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return SelectiveScanOutput(y=y.to(x.dtype), final_states=state, chunk_states=chunk_states)


def selective_scan_pool(
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
    want_chunk_states: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`selective_scan` with the states in the pool: sequence s starts from `ssm_pool[slots[s]]`
    and its final state is written back there. Returns (y, chunk_states or None); chunk_states
    (S, num_chunks, d_inner, d_state) float32 as SelectiveScanOutput's, computed only when asked
    for. On the CPU the threaded C scan runs when it is built and the pool is contiguous float32;
    the Triton kernels read and write the pool directly; otherwise the torch scan and a scatter
    into the pool."""
    if select_backend(x) == "triton":
        from baton.kernels.triton.selective_scan import selective_scan_pool_triton

        return selective_scan_pool_triton(
            x, dt, A, B, C, D, dt_bias, z, ssm_pool, slots, layout, want_chunk_states
        )
    if cpu_mamba1.scan_supported(x, ssm_pool):
        return cpu_mamba1.selective_scan_cpu(
            x, dt, A, B, C, D, dt_bias, z, ssm_pool, slots, layout, want_chunk_states
        )
    out = selective_scan_torch(x, dt, A, B, C, D, dt_bias, z, ssm_pool[slots], layout)
    ssm_pool[slots] = out.final_states.to(ssm_pool.dtype)
    return out.y, out.chunk_states if want_chunk_states else None


def selective_state_update(
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
    """One decode step per row, the pool updated in place at `state_indices` (batch,) int64.
    x, dt, z: (batch, d_inner) (dt raw, z or None); B, C: (batch, d_state); A: (d_inner,
    d_state); D, dt_bias: (d_inner,). Returns y (batch, d_inner) in x's dtype."""
    if select_backend(x) == "triton":
        from baton.kernels.triton.selective_scan import selective_state_update_triton

        return selective_state_update_triton(ssm_pool, x, dt, A, B, C, D, dt_bias, z, state_indices)
    if cpu_mamba1.update_supported(x, ssm_pool):
        return cpu_mamba1.selective_state_update_cpu(
            ssm_pool, x, dt, A, B, C, D, dt_bias, z, state_indices
        )
    return selective_state_update_torch(ssm_pool, x, dt, A, B, C, D, dt_bias, z, state_indices)


def selective_state_update_torch(
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
    delta = F.softplus(dt.float() + dt_bias.float())  # (batch, d_inner)
    state = ssm_pool.index_select(0, state_indices).float()
    state.mul_(torch.exp(delta[..., None] * A.float()))
    state.addcmul_((delta * x.float())[..., None], B.float()[:, None, :])
    ssm_pool.index_copy_(0, state_indices, state.to(ssm_pool.dtype))
    y = torch.bmm(state, C.float()[..., None]).squeeze(-1) + x.float() * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(x.dtype)
