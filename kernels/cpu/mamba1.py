"""The Mamba1 selective scan and decode step in C (kernels/cpu/mamba1.c), compiled once per machine
and called as a torch operator from the one extension (kernels/cpu/extension.py; `BATON_CPU_OPS=0`
to turn off). Without a compiler, with it off, or for a pool that is not contiguous float32 the
torch path of kernels/selective_scan.py runs instead; they agree to float32 rounding
(tests/test_selective_scan.py).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library
from baton.kernels.layouts import ChunkLayout

SOURCE = Path(__file__).with_name("mamba1.c")


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: the Mamba1 scan runs the (slower) torch path."""
    return cpu_library()


def _supported(x: torch.Tensor, ssm_pool: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and select_backend(x) == "torch"
        and ssm_pool.dtype == torch.float32
        and ssm_pool.is_contiguous()
        and library() is not None
    )


scan_supported = update_supported = _supported


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (rows, width) as float32 with unit column stride (strided rows pass without a copy)."""
    t = t.float()
    return t if t.stride(1) == 1 else t.contiguous()


def _check(result: int, slots: torch.Tensor, num_slots: int, what: str) -> None:
    if result:
        row = result - 1
        raise IndexError(
            f"{what}: slot index {int(slots[row])} of row {row} is outside the pool of {num_slots}"
        )


def selective_scan_cpu(
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
    want_chunk_states: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """baton.kernels.selective_scan.selective_scan_pool on the C scan (same contract)."""
    T, width = x.shape
    N = A.shape[1]
    S = slots.shape[0]
    xf, zf = _rows(x), _rows(z) if z is not None else None
    delta = F.softplus(dt.float() + dt_bias.float())
    Bf, Cf = _rows(B), _rows(C)
    if Bf.stride(0) != Cf.stride(0):
        Bf, Cf = Bf.contiguous(), Cf.contiguous()
    Af, Df = A.float().contiguous(), D.float().contiguous()
    slots64 = slots.to(torch.int64).contiguous()
    cu = layout.cu_seqlens.to(torch.int64).contiguous()
    starts = layout.start_pos.to(torch.int64).contiguous()
    y = torch.empty(T, width, dtype=torch.float32)
    chunk_states = (
        torch.empty(S, layout.num_chunks, width, N, dtype=torch.float32)
        if want_chunk_states
        else None
    )
    result = library().baton_mamba1_scan(
        xf,
        xf.stride(0),
        delta,
        delta.stride(0),
        Af,
        Bf,
        Cf,
        Bf.stride(0),
        Df,
        zf,
        zf.stride(0) if zf is not None else 0,
        ssm_pool,
        ssm_pool.shape[0],
        slots64,
        cu,
        starts,
        S,
        y,
        chunk_states,
        layout.num_chunks,
        width,
        N,
        layout.chunk_size,
        torch.get_num_threads(),
    )
    _check(result, slots64, ssm_pool.shape[0], "selective scan")
    return y.to(x.dtype), chunk_states


def selective_state_update_cpu(
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
    """baton.kernels.selective_scan.selective_state_update_torch in one C pass (same contract)."""
    batch, width = x.shape
    N = A.shape[1]
    xf, Bf, Cf = (t.float().contiguous() for t in (x, B, C))
    delta = F.softplus(dt.float() + dt_bias.float())
    zf = z.float().contiguous() if z is not None else None
    Af, Df = A.float().contiguous(), D.float().contiguous()
    slots = state_indices.to(torch.int64).contiguous()
    y = torch.empty(batch, width, dtype=torch.float32)
    result = library().baton_mamba1_update(
        ssm_pool,
        ssm_pool.shape[0],
        slots,
        batch,
        xf,
        delta,
        Af,
        Bf,
        Cf,
        Df,
        zf,
        y,
        width,
        N,
        torch.get_num_threads(),
    )
    _check(result, slots, ssm_pool.shape[0], "selective state update")
    return y.to(x.dtype)
