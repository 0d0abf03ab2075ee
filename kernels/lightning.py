"""Lightning attention (MiniMax-Text-01 / M1): linear attention with a fixed exponential decay per
head, torch path.

Per head h with decay rate lambda_h (a constant of the layer: MiniMax's slope rate) and
g = exp(-lambda_h), the state S (dk, dv) and the output of token t are

    S_t = g S_{t-1} + k_t^T v_t          o_t = q_t S_t

with no softmax, no normalisation and no scale (transformers 5.25's MiniMaxLightningAttention:
its block-wise prefill and its one-token decode are this recurrence).

Prefill (lightning_prefill) lays each sequence out on its aligned chunk grid (kernels/layouts.py's
ChunkLayout) and runs chunk by chunk, batched over sequences and heads. Within a chunk, token i
(offsets from the chunk start; a resumed sequence's first chunk starts at offset a > 0, its last
ends at e < L - 1, padding slots hold zeros) gets

    o_i = g^(i - a + 1) q_i S_in + sum_{a <= j <= i} g^(i - j) (q_i . k_j) v_j
    S_out = g^(e - a + 1) S_in + sum_{a <= j <= e} g^(e - j) k_j^T v_j

Every exponent is >= 0 (no growing factors), and S_out is the true state after the chunk's last
token, so the states after full chunks are the prefix checkpoints. Decode (lightning_decode)
is the recurrence for one token per row.

Shapes: q, k, v, o: (num_tokens, heads, head_dim); decay: (heads,) float32 lambda; state pools
(num_slots, heads, head_dim, head_dim) float32; slot 0 is the dummy slot padded rows use.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from baton.kernels.backend import select_backend
from baton.kernels.cpu import lightning as cpu_lightning
from baton.kernels.layouts import ChunkLayout


class LightningScan(NamedTuple):
    out: torch.Tensor  # (num_tokens, heads, head_dim) in q's dtype
    final_states: torch.Tensor  # (num_seqs, heads, dk, dv) float32
    chunk_states: torch.Tensor  # (num_seqs, num_chunks, heads, dk, dv) float32, after each chunk


def lightning_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    initial_states: torch.Tensor,
    layout: ChunkLayout,
) -> LightningScan:
    S, Cn, L = layout.num_seqs, layout.num_chunks, layout.chunk_size
    T, H, d = q.shape

    def aligned(t: torch.Tensor) -> torch.Tensor:  # (T, H, d) -> (S, Cn, H, L, d), zeros padded
        padded = torch.cat([t.float(), t.new_zeros(1, H, t.shape[-1], dtype=torch.float32)])
        return padded[layout.slot_token].view(S, Cn, L, H, -1).transpose(2, 3)

    qa, ka, va = aligned(q), aligned(k), aligned(v)
    real = (layout.slot_token < T).view(S, Cn, L)
    offsets = torch.arange(L, device=q.device)
    # first (a) and last (e) real offset of each chunk; an empty chunk gets a = L, e = L - 1
    a = torch.where(real, offsets, L).amin(-1)
    e = torch.where(real, offsets, -1).amax(-1)
    e = torch.where(e < 0, L - 1, e)
    lam = decay.float().view(1, H, 1)
    i = offsets.view(1, 1, L)
    diff = (i[..., :, None] - i[..., None, :]).float()  # (1, 1, L, L): i - j
    intra_decay = torch.where(diff >= 0, torch.exp(-lam[..., None] * diff.clamp(min=0)), 0.0)
    state = initial_states.float().clone()  # (S, H, dk, dv)
    out = torch.empty(S, Cn, H, L, v.shape[-1], dtype=torch.float32, device=q.device)
    chunk_states = torch.empty(S, Cn, *state.shape[1:], dtype=torch.float32, device=q.device)
    for c in range(Cn):
        qc, kc, vc = qa[:, c], ka[:, c], va[:, c]  # (S, H, L, d)
        ac, ec = a[:, c].view(S, 1, 1).float(), e[:, c].view(S, 1, 1).float()
        into = torch.exp(-lam * (i - ac + 1).clamp(min=0))  # (S, H, L): g^(i - a + 1)
        scores = (qc @ kc.transpose(-1, -2)) * intra_decay
        out[:, c] = scores @ vc + (qc * into[..., None]) @ state
        to_end = torch.exp(-lam * (ec - i).clamp(min=0))  # (S, H, L): g^(e - j)
        carried = torch.exp(-lam * (ec - ac + 1).clamp(min=0))  # (S, H, 1): g^(e - a + 1)
        state = carried[..., None] * state + (kc * to_end[..., None]).transpose(-1, -2) @ vc
        chunk_states[:, c] = state
    flat = out.transpose(2, 3).reshape(S * Cn * L, H, -1)
    return LightningScan(
        out=flat[layout.token_slot].to(q.dtype), final_states=state, chunk_states=chunk_states
    )


def lightning_prefill_pool(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    layout: ChunkLayout,
) -> LightningScan:
    """`lightning_prefill` from and back into the pool: sequence s starts from
    `state_pool[slots[s]]` (zeros for a fresh slot) and its final state is written there.
    CUDA tensors run the Triton recurrence (kernels/triton/lightning.py), CPU tensors the C
    scan (kernels/cpu/lightning.c) when built and the pool is contiguous float32."""
    if select_backend(v) == "triton":
        from baton.kernels.triton.lightning import lightning_prefill_pool_triton

        out, chunks = lightning_prefill_pool_triton(q, k, v, decay, state_pool, slots, layout)
        return LightningScan(out=out, final_states=state_pool[slots].float(), chunk_states=chunks)
    if cpu_lightning.supported(v, state_pool):
        out, chunks = cpu_lightning.lightning_prefill_cpu(q, k, v, decay, state_pool, slots, layout)
        return LightningScan(out=out, final_states=state_pool[slots].float(), chunk_states=chunks)
    scan = lightning_prefill(q, k, v, decay, state_pool[slots], layout)
    state_pool[slots] = scan.final_states.to(state_pool.dtype)
    return scan


def lightning_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    decay: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token per row: q, k, v (batch, heads, head_dim); the pool updated in place at
    `slots` (batch,). Returns o (batch, heads, head_dim) in q's dtype. The C step treats rows
    on the dummy slot 0 as padding (o = 0, slot untouched); the torch step runs them on it."""
    if select_backend(v) == "triton":
        from baton.kernels.triton.lightning import lightning_decode_triton

        return lightning_decode_triton(q, k, v, decay, state_pool, slots)
    if cpu_lightning.supported(v, state_pool):
        return cpu_lightning.lightning_decode_cpu(q, k, v, decay, state_pool, slots)
    ratio = torch.exp(-decay.float()).view(1, -1, 1, 1)
    state = state_pool.index_select(0, slots).float()
    state = ratio * state + k.float()[..., :, None] * v.float()[..., None, :]
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))
    return (q.float()[..., None, :] @ state).squeeze(-2).to(q.dtype)


def lightning_layer_decode(
    qkv: torch.Tensor,
    gate: torch.Tensor,
    norm_weight: torch.Tensor,
    decay: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    eps: float,
) -> torch.Tensor | None:
    """The lightning layer's whole decode step on one rank, from its projections' rows (qkv
    before the SiLU, gate before the sigmoid) to out_proj's input, where a fused kernel runs it:
    the C step on the CPU (kernels/cpu/lightning.c). None where none does (the layer runs
    `lightning_decode` between its own ops)."""
    if select_backend(qkv) == "triton" or not cpu_lightning.lightning_layer_decode_supported(
        qkv, state_pool
    ):
        return None
    return cpu_lightning.lightning_layer_decode_cpu(
        qkv, gate, norm_weight, decay, state_pool, slots, eps
    )
