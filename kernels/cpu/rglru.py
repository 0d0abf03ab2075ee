"""RecurrentGemma's recurrent block on the CPU (kernels/cpu/rglru.c), compiled once per machine into
the operator extension (kernels/cpu/extension.py): the fused decode step of the conv and the
RG-LRU, both pools updated in place, and the prefill scan on pool slots with chunk-end states. `BATON_CPU_OPS=0`, no compiler, a failed build or pools of
another layout select the torch path (kernels/conv1d.py + kernels/rglru.py), which agrees to
float32 rounding (tests/test_rglru.py).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library
from baton.kernels.layouts import ChunkLayout
from baton.kernels.rglru import RGLRUWeights


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators, or None: the RG-LRU runs its torch path."""
    return cpu_library()


class RGLRUDecodeParams(NamedTuple):
    """One recurrent block's small parameters as the fused decode step reads them (float32,
    contiguous; values of the model dtype)."""

    conv_weight: torch.Tensor  # (W, K)
    conv_bias: torch.Tensor  # (W,)
    input_gate_weight: torch.Tensor  # (H, bw, bw)
    input_gate_bias: torch.Tensor  # (H, bw)
    recurrent_gate_weight: torch.Tensor  # (H, bw, bw)
    recurrent_gate_bias: torch.Tensor  # (H, bw)
    softplus_lambda: torch.Tensor  # (W,) softplus(recurrent_param), rounded in the model dtype

    @classmethod
    def of(
        cls, conv_weight: torch.Tensor, conv_bias: torch.Tensor, weights: RGLRUWeights
    ) -> RGLRUDecodeParams:
        def f32(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().contiguous()

        return cls(
            conv_weight=f32(conv_weight),
            conv_bias=f32(conv_bias),
            input_gate_weight=f32(weights.input_gate_weight),
            input_gate_bias=f32(weights.input_gate_bias),
            recurrent_gate_weight=f32(weights.recurrent_gate_weight),
            recurrent_gate_bias=f32(weights.recurrent_gate_bias),
            softplus_lambda=f32(F.softplus(weights.recurrent_param.detach())),
        )


def decode_supported(x: torch.Tensor, conv_pool: torch.Tensor, state_pool: torch.Tensor) -> bool:
    """CPU tensors on the torch backend, x and the conv pool float32 or bfloat16 alike, a
    contiguous float32 state pool, the library built."""
    return (
        x.device.type == "cpu"
        and select_backend(x) == "torch"
        and x.dtype in (torch.float32, torch.bfloat16)
        and conv_pool.dtype == x.dtype
        and conv_pool.is_contiguous()
        and state_pool.dtype == torch.float32
        and state_pool.is_contiguous()
        and library() is not None
    )


def rglru_decode_cpu(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    params: RGLRUDecodeParams,
) -> torch.Tensor:
    """x: (batch, W) linear_x's outputs; conv_pool (num_slots, W, K-1); state_pool (num_slots,
    W) float32; slots (batch,) int64. Returns the RG-LRU's y (batch, W) in x's dtype."""
    batch, W = x.shape
    H, bw = params.input_gate_bias.shape
    slots64 = slots.to(torch.int64).contiguous()
    y = torch.empty_like(x)
    u = torch.empty(batch, W, dtype=torch.float32)
    result = library().baton_rglru_decode(
        x.contiguous(), conv_pool, state_pool, state_pool.shape[0], slots64, batch,
        params.conv_weight, params.conv_bias, params.conv_weight.shape[1],
        params.input_gate_weight, params.input_gate_bias,
        params.recurrent_gate_weight, params.recurrent_gate_bias, params.softplus_lambda,
        u, y, int(x.dtype == torch.bfloat16), H, bw, torch.get_num_threads(),
    )  # fmt: skip
    if result:
        row = result - 1
        raise IndexError(
            f"RG-LRU: slot index {int(slots64[row])} of row {row} is outside the pool of "
            f"{state_pool.shape[0]}"
        )
    return y


def scan_supported(u: torch.Tensor, state_pool: torch.Tensor) -> bool:
    """CPU tensors on the torch backend, a contiguous float32 state pool, the library built."""
    return (
        u.device.type == "cpu"
        and select_backend(u) == "torch"
        and state_pool.dtype == torch.float32
        and state_pool.is_contiguous()
        and library() is not None
    )


def rglru_scan_cpu(
    a: torch.Tensor,
    u: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/rglru.py's rglru_scan_pool on the C scan (threaded over (sequence, block of 64
    channels)): (y (T, W) in u's dtype, chunk_states (num_seqs, num_chunks, W) float32); the
    final states are left in the pool."""
    T, W = u.shape
    slots64 = slots.to(torch.int64).contiguous()
    chunk_states = torch.empty(layout.num_seqs, layout.num_chunks, W)
    y = torch.empty(T, W, dtype=torch.float32)
    result = library().baton_rglru_scan(
        a.float().contiguous(), u.float().contiguous(), state_pool, state_pool.shape[0], slots64,
        layout.cu_seqlens.to(torch.int64).contiguous(),
        layout.start_pos.to(torch.int64).contiguous(), slots64.shape[0], layout.chunk_size,
        chunk_states, layout.num_chunks, y, W, torch.get_num_threads(),
    )  # fmt: skip
    if result:
        row = result - 1
        raise IndexError(
            f"RG-LRU: slot index {int(slots64[row])} of sequence {row} is outside the pool of "
            f"{state_pool.shape[0]}"
        )
    return y.to(u.dtype), chunk_states
