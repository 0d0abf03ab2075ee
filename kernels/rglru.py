"""The Real-Gated Linear Recurrent Unit (RG-LRU, Griffin / RecurrentGemma), torch path.

Per channel c of the LRU width, with x the conv's output (model dtype) and p the absolute
position of the token:

    i_t = sigmoid(x_t W_i + b_i)         r_t = sigmoid(x_t W_r + b_r)   (block-diagonal: one
    log a_t = -8 r_t softplus(lambda)                                    (bw, bw) block per head)
    a_t = exp(log a_t)
    u_t = x_t i_t * (1 if p == 0 else sqrt(1 - exp(2 log a_t)))
    h_t = a_t h_{t-1} + u_t   (float32; a_t = 0 at p == 0: a sequence starts from zeros)
    y_t = h_t in the model dtype

rglru_inputs computes (a, u) op for op as transformers 5.25's RecurrentGemmaRglru does (in the
model dtype: a bf16 model rounds its gates in bf16 too). The recurrence is then a diagonal linear
scan; the state is float32 (transformers keeps `recurrent_states` in float32 for any model dtype).

Prefill (rglru_scan) lays each sequence out on its aligned chunk grid (kernels/layouts.py's
ChunkLayout: the slots before a resumed sequence's first token and after its last are padding)
and runs a Hillis-Steele scan over the grid: log2(span) vectorised steps of the associative
combine (a1, u1) . (a2, u2) = (a1 a2, a2 u1 + u2), padding being the identity (1, 0). Only
products of factors in [0, 1] occur, so no rescaling is needed, and the state after every chunk
of the grid (a prefix checkpoint) is read off the scan. The initial state enters through the
cumulative product of a. Decode (rglru_update) is the recurrence for one token per row.

Shapes: x, a, u, y: (num_tokens, width); state pools: (num_slots, width) float32; slot 0 is the
dummy slot padded rows read and write.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.layouts import ChunkLayout


class RGLRUWeights(NamedTuple):
    """One RG-LRU's parameters as transformers stores them (this rank's heads)."""

    recurrent_param: torch.Tensor  # (width,) lambda
    input_gate_weight: torch.Tensor  # (heads, bw, bw)
    input_gate_bias: torch.Tensor  # (heads, bw)
    recurrent_gate_weight: torch.Tensor  # (heads, bw, bw)
    recurrent_gate_bias: torch.Tensor  # (heads, bw)


class RGLRUScan(NamedTuple):
    y: torch.Tensor  # (num_tokens, width) in u's dtype
    final_states: torch.Tensor  # (num_seqs, width) float32
    chunk_states: torch.Tensor  # (num_seqs, num_chunks, width) float32, after each aligned chunk


def rglru_inputs(
    x: torch.Tensor, positions: torch.Tensor, weights: RGLRUWeights
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (T, width) conv outputs; positions: (T,) int64 absolute positions. Returns (a, u),
    both (T, width) in x's dtype: the decay and the normalised, gated input."""
    T, width = x.shape
    heads, bw = weights.input_gate_bias.shape
    by_head = x.reshape(T, heads, bw).transpose(0, 1)  # (heads, T, bw)

    def gate(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(
            torch.baddbmm(b[:, None, :], by_head, w).transpose(0, 1).reshape(T, -1)
        )

    input_gate = gate(weights.input_gate_weight, weights.input_gate_bias)
    recurrent_gate = gate(weights.recurrent_gate_weight, weights.recurrent_gate_bias)
    log_a = -8.0 * recurrent_gate * F.softplus(weights.recurrent_param)
    a = torch.exp(log_a)
    multiplier = torch.sqrt(1 - torch.exp(2 * log_a))
    reset = (positions == 0)[:, None]
    multiplier = torch.where(reset, torch.ones_like(multiplier), multiplier)
    u = (x * input_gate) * multiplier.to(x.dtype)
    # a sequence's first token forgets whatever the state held (transformers: a * ~reset)
    return a.masked_fill(reset, 0.0), u


def rglru_scan(
    a: torch.Tensor, u: torch.Tensor, initial_states: torch.Tensor, layout: ChunkLayout
) -> RGLRUScan:
    """a, u: (T, width) packed prefill rows; initial_states: (S, width) float32."""
    S, span = layout.num_seqs, layout.num_chunks * layout.chunk_size
    width = a.shape[1]

    def aligned(t: torch.Tensor, pad: float) -> torch.Tensor:  # (T, w) -> (S, span, w)
        padded = torch.cat([t.float(), t.new_full((1, width), pad, dtype=torch.float32)])
        return padded[layout.slot_token].view(S, span, width)

    decay, h = aligned(a, 1.0), aligned(u, 0.0)
    step = 1
    while step < span:  # Hillis-Steele: after it, decay = prod a[..t], h = scan from zeros
        h = torch.cat([h[:, :step], torch.addcmul(h[:, step:], decay[:, step:], h[:, :-step])], 1)
        decay = torch.cat([decay[:, :step], decay[:, step:] * decay[:, :-step]], 1)
        step *= 2
    h = h + decay * initial_states.float()[:, None, :]
    y = h.view(S * span, width)[layout.token_slot].to(u.dtype)
    chunk_states = h.view(S, layout.num_chunks, layout.chunk_size, width)[:, :, -1]
    return RGLRUScan(y=y, final_states=h[:, -1], chunk_states=chunk_states)


def rglru_scan_pool(
    a: torch.Tensor,
    u: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    layout: ChunkLayout,
) -> RGLRUScan:
    """`rglru_scan` from and back into the pool: sequence s starts from `state_pool[slots[s]]`
    (zeros for a fresh slot) and its final state is written there. CUDA tensors run the Triton
    scan (kernels/triton/rglru.py), CPU tensors the C scan (kernels/cpu/rglru.c) when
    built and the pool is contiguous float32."""
    if select_backend(u) == "triton":
        from baton.kernels.triton.rglru import rglru_scan_pool_triton

        y, chunks = rglru_scan_pool_triton(a, u, state_pool, slots, layout)
        return RGLRUScan(y=y, final_states=state_pool[slots].float(), chunk_states=chunks)
    from baton.kernels.cpu import rglru as cpu_rglru  # it imports this module's types

    if cpu_rglru.scan_supported(u, state_pool):
        y, chunks = cpu_rglru.rglru_scan_cpu(a, u, state_pool, slots, layout)
        return RGLRUScan(y=y, final_states=state_pool[slots].float(), chunk_states=chunks)
    out = rglru_scan(a, u, state_pool[slots], layout)
    state_pool[slots] = out.final_states.to(state_pool.dtype)
    return out


def rglru_update(
    a: torch.Tensor, u: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor
) -> torch.Tensor:
    """One token per row: a, u (batch, width); the pool updated in place at `slots` (batch,).
    Returns y (batch, width) in u's dtype."""
    if select_backend(u) == "triton":
        from baton.kernels.triton.rglru import rglru_update_triton

        return rglru_update_triton(a, u, state_pool, slots)
    state = torch.addcmul(u.float(), a.float(), state_pool.index_select(0, slots).float())
    state_pool.index_copy_(0, slots, state.to(state_pool.dtype))
    return state.to(u.dtype)
