"""Batched LoRA on the CPU (kernels/cpu/lora.c), compiled once per machine into the operator
extension (kernels/cpu/extension.py): the shrink of each row through its own slot's A (every
part of a fused projection at once) and the expand through its slot's B into out, in place.
Shapes and semantics: kernels/lora.py. `BATON_CPU_OPS=0`, no compiler, a failed build or other
dtypes select the torch paths.
"""

from __future__ import annotations

import functools

import torch

from baton.kernels.backend import select_backend
from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library

_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators, or None: LoRA runs a torch path."""
    return cpu_library()


def supported(x: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> bool:
    """CPU tensors on the torch backend; x, out and the table's rows float32 or bfloat16 (each
    its own), the table contiguous, out with unit column stride; the library built."""
    return (
        x.device.type == "cpu"
        and select_backend(x) == "torch"
        and x.dtype in _DTYPES
        and rows.dtype in _DTYPES
        and out.dtype in _DTYPES
        and rows.is_contiguous()
        and out.stride(-1) == 1
        and library() is not None
    )


def _check_slots(lora_slots: torch.Tensor) -> None:
    if lora_slots.dtype != torch.int64 or not lora_slots.is_contiguous():
        raise ValueError(f"LoRA: lora_slots must be contiguous int64, got {lora_slots.dtype}")


def _refuse(result: int, lora_slots: torch.Tensor, num_slots: int) -> None:
    if result:
        row = result - 1
        raise IndexError(
            f"LoRA: slot index {int(lora_slots[row])} of row {row} is outside the table of "
            f"{num_slots} slots"
        )


def lora_shrink_cpu(
    x: torch.Tensor, a_rows: torch.Tensor, lora_slots: torch.Tensor, rank: int, parts: int
) -> torch.Tensor:
    """kernels/lora.py's lora_shrink: low (T, parts * rank) float32."""
    _check_slots(lora_slots)
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, width = x.shape
    num_slots = a_rows.shape[0] // (parts * rank)
    low = torch.empty(T, parts * rank, dtype=torch.float32)
    result = library().baton_lora_shrink(
        x, x.stride(0), int(x.dtype == torch.bfloat16), T, width, a_rows,
        int(a_rows.dtype == torch.bfloat16), num_slots, rank, parts, lora_slots, low,
        torch.get_num_threads(),
    )  # fmt: skip
    _refuse(result, lora_slots, num_slots)
    return low


def lora_expand_cpu(
    low: torch.Tensor, b_rows: torch.Tensor, lora_slots: torch.Tensor, rank: int, out: torch.Tensor
) -> None:
    """kernels/lora.py's lora_expand: out (T, n) += low[:, :rank] @ each row's slot's B."""
    _check_slots(lora_slots)
    if low.dtype != torch.float32 or low.stride(-1) != 1:
        raise ValueError("LoRA: low must be float32 with unit column stride (lora_shrink's)")
    T, n = out.shape
    num_slots = b_rows.shape[0] // rank
    result = library().baton_lora_expand(
        low, low.stride(0), T, b_rows, int(b_rows.dtype == torch.bfloat16), num_slots, rank, n,
        lora_slots, out, out.stride(0), int(out.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    _refuse(result, lora_slots, num_slots)
