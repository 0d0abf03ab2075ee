"""Copy Mamba states into checkpoint slots (prefix caching), Triton path
(semantics: kernels/state_copy.py).

    dst_pool[dst_slots[i]] = src[src_index[i]]    for i in 0..M-1, cast to dst_pool's dtype

One program copies one BLOCK-element stretch of one state. A state is everything past the slot
axis (conv window (conv_dim, K-1) or SSM state (nheads, headdim, dstate)) and must be
contiguous inside its slot; the slot stride is free, so a layer's view of a layer-major pool
works. Destination rows must not overlap source rows (a working slot is never its own
checkpoint). No autotune: it writes state in place.
"""

from __future__ import annotations

import math

import torch

import triton
import triton.language as tl


# fmt: off
@triton.jit
def _copy_states_kernel(
    dst_ptr, dst_slots_ptr, src_ptr, src_index_ptr,
    stride_dst, stride_src, numel,
    BLOCK: tl.constexpr,
):
    # fmt: on
    i = tl.program_id(0)
    e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    e_ok = e < numel
    src_row = tl.load(src_index_ptr + i).to(tl.int64)
    dst_row = tl.load(dst_slots_ptr + i).to(tl.int64)
    values = tl.load(src_ptr + src_row * stride_src + e, mask=e_ok)
    tl.store(dst_ptr + dst_row * stride_dst + e, values.to(dst_ptr.dtype.element_ty), mask=e_ok)


def _row_contiguous(t: torch.Tensor) -> bool:
    expected = 1
    for size, stride in zip(reversed(t.shape[1:]), reversed(t.stride()[1:])):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def copy_states_triton(
    dst_pool: torch.Tensor, dst_slots: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor
) -> None:
    """dst_pool: (num_slots, *state) any float dtype; src: (num_src, *state) any float dtype;
    dst_slots, src_index: (M,) int. Each state must be contiguous within its row."""
    if dst_pool.shape[1:] != src.shape[1:]:
        raise ValueError(f"state shapes differ: pool {tuple(dst_pool.shape[1:])}, "
                         f"source {tuple(src.shape[1:])}")
    if dst_slots.dim() != 1 or dst_slots.shape != src_index.shape:
        raise ValueError(f"dst_slots and src_index must both be (M,), got "
                         f"{tuple(dst_slots.shape)} and {tuple(src_index.shape)}")
    if not (_row_contiguous(dst_pool) and _row_contiguous(src)):
        raise ValueError("copy_states_triton: each state must be contiguous inside its slot")
    if len({t.device for t in (dst_pool, dst_slots, src, src_index)}) != 1:
        raise ValueError("copy_states_triton: all tensors must share one device")
    M, numel = dst_slots.shape[0], math.prod(src.shape[1:])
    if M == 0 or numel == 0:
        return
    BLOCK = min(4096, triton.next_power_of_2(numel))
    _copy_states_kernel[(M, triton.cdiv(numel, BLOCK))](
        dst_pool, dst_slots, src, src_index,
        dst_pool.stride(0), src.stride(0), numel,
        BLOCK=BLOCK, num_warps=4,
    )
