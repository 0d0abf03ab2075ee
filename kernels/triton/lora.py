"""Batched LoRA in Triton (punica's bgmv shrink and expand): semantics and shapes are
kernels/lora.py's; these launchers are what it runs under the Triton backend.

    shrink: one program per (row, part): low[t, p r : (p + 1) r] = A_(p, s) x[t], the row's own
            slot s only, reduced over blocks of BLOCK_K input columns (zeros for s = -1)
    expand: one program per (row, block of BLOCK_N output columns):
            out[t, cols] += low[t, :r] @ B[s r : (s + 1) r, cols]; rows with s = -1 store nothing

Every value is upcast to float32 right after its load (bf16 arithmetic is wrong in the
interpreter, and float32 accumulation is what the C kernels do); out is rounded once. A decode
batch is a few rows, and a row per program reads each slot's matrices once per row.

From GROUPED_ROWS rows on (prefill, where a sequence's tokens are consecutive rows of one slot),
the grouped kernels (punica's sgmv) take BLOCK_T rows per program and, for each slot some row of
the block uses, one tl.dot of the block through that slot's A (or B), keeping each row's own
result: a block inside one sequence costs one matmul, a block across a boundary a few. The
expand's tl.dot rounds low to B's dtype when B is 16-bit (as punica does); float32 stays IEEE.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.backend import dot_precision

GROUPED_ROWS = 64  # from this many rows on, the grouped (tl.dot) kernels run
BLOCK_T = 16  # rows per program of the grouped kernels (tl.dot's minimum)


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


# fmt: off
@triton.jit
def _lora_shrink_grouped_kernel(
    x_ptr, a_ptr, slots_ptr, low_ptr, stride_x, stride_a, stride_low, T, width, num_slots,
    RANK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    p = tl.program_id(1).to(tl.int64)
    t_ok = t < T
    row_slots = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    rank_ok = j < RANK
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for s in range(0, num_slots):
        mine = row_slots == s
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            rows = (p * num_slots + s) * RANK + j
            part = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for k0 in range(0, width, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_ok = k < width
                x = tl.load(x_ptr + t[:, None] * stride_x + k[None, :],
                            mask=(mine & t_ok)[:, None] & k_ok[None, :], other=0.0)
                a = tl.load(a_ptr + rows[None, :] * stride_a + k[:, None],
                            mask=k_ok[:, None] & rank_ok[None, :], other=0.0)
                part += tl.dot(x.to(a.dtype), a, input_precision=DOT_PRECISION)
            acc = tl.where(mine[:, None], part, acc)
    tl.store(low_ptr + t[:, None] * stride_low + p * RANK + j[None, :], acc,
             mask=t_ok[:, None] & rank_ok[None, :])


# fmt: off
@triton.jit
def _lora_expand_grouped_kernel(
    low_ptr, b_ptr, slots_ptr, out_ptr, stride_low, stride_b, stride_out, T, n, num_slots,
    RANK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # fmt: on
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok, c_ok = t < T, c < n
    row_slots = tl.load(slots_ptr + t, mask=t_ok, other=-1).to(tl.int64)
    j = tl.arange(0, BLOCK_R)
    rank_ok = j < RANK
    low = tl.load(low_ptr + t[:, None] * stride_low + j[None, :],
                  mask=t_ok[:, None] & rank_ok[None, :], other=0.0)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for s in range(0, num_slots):
        mine = row_slots == s
        if tl.sum(mine.to(tl.int32), axis=0) > 0:
            b = tl.load(b_ptr + (s * RANK + j)[:, None] * stride_b + c[None, :],
                        mask=rank_ok[:, None] & c_ok[None, :], other=0.0)
            part = tl.dot(tl.where(mine[:, None], low, 0.0).to(b.dtype), b,
                          input_precision=DOT_PRECISION)
            acc = tl.where(mine[:, None], part, acc)
    at = out_ptr + t[:, None] * stride_out + c[None, :]
    ok = (t_ok & (row_slots >= 0))[:, None] & c_ok[None, :]
    current = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    tl.store(at, (current + acc).to(out_ptr.dtype.element_ty), mask=ok)


def _check(rows: torch.Tensor, what: str) -> None:
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError(f"{what}: the slot table's rows must be 2-D with unit column stride")


def _dot_block(rank: int) -> int:
    return max(triton.next_power_of_2(rank), 16)  # tl.dot's operands are at least 16 wide


def lora_shrink_triton(x, a_rows, lora_slots, rank: int, parts: int) -> torch.Tensor:
    """kernels/lora.py's lora_shrink: low (T, parts * rank) float32."""
    _check(a_rows, "lora_shrink")
    x = x if x.stride(-1) == 1 else x.contiguous()
    T, width = x.shape
    low = torch.empty(T, parts * rank, device=x.device, dtype=torch.float32)
    if T == 0:
        return low
    num_slots = a_rows.shape[0] // (parts * rank)
    if T >= GROUPED_ROWS:
        # fmt: off
        _lora_shrink_grouped_kernel[(triton.cdiv(T, BLOCK_T), parts)](
            x, a_rows, lora_slots, low, x.stride(0), a_rows.stride(0), low.stride(0), T, width,
            num_slots, RANK=rank, BLOCK_T=BLOCK_T, BLOCK_R=_dot_block(rank),
            BLOCK_K=min(max(triton.next_power_of_2(width), 16), 64),
            DOT_PRECISION=dot_precision(a_rows.dtype), num_warps=4,
        )
        # fmt: on
        return low
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
    if T >= GROUPED_ROWS:
        BLOCK_N = min(max(triton.next_power_of_2(n), 16), 64)
        # fmt: off
        _lora_expand_grouped_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(n, BLOCK_N))](
            low, b_rows, lora_slots, out, low.stride(0), b_rows.stride(0), out.stride(0), T, n,
            b_rows.shape[0] // rank, RANK=rank, BLOCK_T=BLOCK_T, BLOCK_R=_dot_block(rank),
            BLOCK_N=BLOCK_N, DOT_PRECISION=dot_precision(b_rows.dtype), num_warps=4,
        )
        # fmt: on
        return
    BLOCK_N = min(triton.next_power_of_2(n), 256)
    # fmt: off
    _lora_expand_kernel[(T, triton.cdiv(n, BLOCK_N))](
        low, b_rows, lora_slots, out, low.stride(0), b_rows.stride(0), out.stride(0), n,
        RANK=rank, BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=BLOCK_N, num_warps=4,
    )
    # fmt: on
