"""What the Triton paths of the slot-state recurrences share: the chunk-end state stores and the
tile choices. Those paths (kernels/triton/kda.py, lightning.py, rglru.py) are what Kimi Delta
Attention (kernels/kda.py), lightning attention (kernels/lightning.py) and the RG-LRU's diagonal
scan (kernels/rglru.py) dispatch to for CUDA tensors (or under BATON_KERNELS=triton); semantics
and shapes are those modules'.

Every kernel is the recurrence itself, token by token (FLA's "fused recurrent" form): one program
owns one sequence (prefill) or one row (decode), one head and a block of the state's value
columns (RG-LRU: a block of channels), keeps that state tile in registers in float32 while it
walks the sequence's tokens in order, and writes it back in place at the end. Prefill stores the
tile at every aligned chunk end (absolute position + 1 a multiple of the chunk size: the prefix
checkpoints) and, after the last token, into every chunk at or past the sequence's end, which is
what the torch paths' padded no-op slots leave there. A recurrent prefill is linear in the
prompt; a chunked (tensor-core) prefill is the next step where prompts are long.

Programs of one slot own disjoint columns; a CTA barrier separates a program's reads of its tile
from its rewrite. KDA's padded decode rows (slot 0) neither read nor write and give o = 0, as the
torch path; lightning's and the RG-LRU's write the dummy slot 0, as theirs do. No autotune: these
kernels write state in place.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


@triton.jit
def store_chunk_ends(chunk_at, stride_c, state, mask, offset, j, L):
    """The state after token j (of a sequence whose first token sits at `offset` in its chunk)
    when that token closes an aligned chunk."""
    if (offset + j + 1) % L == 0:
        tl.store(chunk_at + (offset + j) // L * stride_c, state, mask=mask)


@triton.jit
def store_tail_chunks(chunk_at, stride_c, state, mask, offset, count, L, num_chunks):
    for c in range((offset + count) // L, num_chunks):
        tl.store(chunk_at + c * stride_c, state, mask=mask)


@triton.jit
def head_tile(dk, dv, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """This program's tile of a (H, dk, dv) contiguous slot: its head (program axis 1) and block
    of value columns (axis 2): (key offsets, value columns, their masks, the tile's offsets)."""
    h = tl.program_id(1)
    dk_i = tl.arange(0, BLOCK_K)
    dv_j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    return h, dk_i, dv_j, dk_i < dk, dv_j < dv, h * dk * dv + dk_i[:, None] * dv + dv_j[None, :]


@triton.jit
def store_state(state_ptr, slot, stride_state_s, tile, state, mask):
    """The tile back into its slot, once every thread has read its part of it."""
    tl.debug_barrier()
    tl.store(
        state_ptr + slot * stride_state_s + tile, state.to(state_ptr.dtype.element_ty), mask=mask
    )


def scan_outputs(q: torch.Tensor, v: torch.Tensor, out_dtype: torch.dtype, layout):
    """A prefill scan's outputs: o (T, H, dv) and the chunk-end states (S, num_chunks, H, dk,
    dv) float32."""
    T, H, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty(T, H, dv, device=v.device, dtype=out_dtype)
    chunks = torch.empty(layout.num_seqs, layout.num_chunks, H, dk, dv, device=v.device,
                         dtype=torch.float32)  # fmt: skip
    return o, chunks


def slot_tiles(states: torch.Tensor, what: str) -> None:
    if not states[0].is_contiguous():
        raise ValueError(f"{what}: each state slot must be contiguous")


def v_block(dk: int, dv: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V): the whole key dim, ~4096 state elements per program."""
    BLOCK_K = triton.next_power_of_2(dk)
    return BLOCK_K, min(triton.next_power_of_2(dv), max(16, 4096 // BLOCK_K))
