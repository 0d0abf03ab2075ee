"""Batched LoRA in Triton (punica's bgmv shrink and expand): semantics and shapes are
kernels/lora.py's; these launchers are what it runs under the Triton backend.

    shrink: one program per (row, part): low[t, p r : (p + 1) r] = A_(p, s) x[t], the row's own
            slot s only, reduced over blocks of BLOCK_K input columns (zeros for s = -1)
    expand: one program per (row, block of BLOCK_N output columns):
            out[t, cols] += low[t, :r] @ B[s r : (s + 1) r, cols]; rows with s = -1 store nothing

Every value is upcast to float32 right after its load (bf16 arithmetic is wrong in the
interpreter, and float32 accumulation is what the C kernels do); out is rounded once. Decode
batches are a few rows, so a row per program keeps each slot's matrices streaming once per row;
a prefill of many rows on one adapter would rather group rows by slot (punica's sgmv) and use
tl.dot, which these kernels do not yet do.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


# fmt: off
@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, low_ptr, stride_x, stride_a, stride_low, width, num_slots,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # fmt: on
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    rank_ok = j < RANK
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        rows = (p * num_slots + slot) * RANK + j
        for k0 in range(0, width, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < width
            x = tl.load(x_ptr + t * stride_x + k, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(
                a_ptr + rows[:, None] * stride_a + k[None, :],
                mask=rank_ok[:, None] & k_ok[None, :], other=0.0,
            ).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(low_ptr + t * stride_low + p * RANK + j, acc, mask=rank_ok)


# fmt: off
@triton.jit
def _lora_expand_kernel(
    low_ptr, b_ptr, slots_ptr, out_ptr, stride_low, stride_b, stride_out, n,
    RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # fmt: on
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ok = c < n
    slot = tl.load(slots_ptr + t).to(tl.int64)
    if slot >= 0:
        j = tl.arange(0, BLOCK_R)
        rank_ok = j < RANK
        low = tl.load(low_ptr + t * stride_low + j, mask=rank_ok, other=0.0).to(tl.float32)
        b = tl.load(
            b_ptr + (slot * RANK + j)[:, None] * stride_b + c[None, :],
            mask=rank_ok[:, None] & c_ok[None, :], other=0.0,
        ).to(tl.float32)
        delta = tl.sum(low[:, None] * b, axis=0)
        at = out_ptr + t * stride_out + c
        current = tl.load(at, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(at, (current + delta).to(out_ptr.dtype.element_ty), mask=c_ok)


def _check(rows: torch.Tensor, what: str) -> None:
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError(f"{what}: the slot table's rows must be 2-D with unit column stride")


def lora_shrink_triton(x, a_rows, lora_slots, rank: int, parts: int) -> torch.Tensor:
    """kernels/lora.py's lora_shrink: low (T, parts * rank) float32."""
    _check(a_rows, "lora_shrink")
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, width = x.shape
    low = torch.empty(T, parts * rank, device=x.device, dtype=torch.float32)
    if T == 0:
        return low
    num_slots = a_rows.shape[0] // (parts * rank)
    # fmt: off
    _lora_shrink_kernel[(T, parts)](
        x, a_rows, lora_slots, low, x.stride(0), a_rows.stride(0), low.stride(0), width,
        num_slots, RANK=rank, BLOCK_R=triton.next_power_of_2(rank),
        BLOCK_K=min(triton.next_power_of_2(width), 256), num_warps=4,
    )
    # fmt: on
    return low


def lora_expand_triton(low, b_rows, lora_slots, rank: int, out) -> None:
    """kernels/lora.py's lora_expand: out (T, n) += low[:, :rank] @ each row's slot's B."""
    _check(b_rows, "lora_expand")
    if out.stride(-1) != 1 or low.stride(-1) != 1:
        raise ValueError("lora_expand: out and low need unit column stride")
    T, n = out.shape
    if T == 0:
        return
    BLOCK_N = min(triton.next_power_of_2(n), 256)
    # fmt: off
    _lora_expand_kernel[(T, triton.cdiv(n, BLOCK_N))](
        low, b_rows, lora_slots, out, low.stride(0), b_rows.stride(0), out.stride(0), n,
        RANK=rank, BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=BLOCK_N, num_warps=4,
    )
    # fmt: on
