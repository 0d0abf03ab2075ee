"""The fused CPU Mamba2 verify step (kernels/cpu/verify.c), compiled once per machine like
kernels/cpu/ops.py's decode step, and its torch equivalent.

A speculative verify feeds q = k + 1 tokens per request and must keep the conv window and the
SSM state after every one of them (acceptance picks one afterwards). The torch path runs the
multi-token conv and the multi-token state update (kernels/conv1d.py, kernels/ssu.py: the GPU's
path too) and then the gate; the C step does all three in one pass that keeps each state row in
registers across the q tokens and writes it once per token to its slot.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from baton.kernels.backend import select_backend
from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library
from baton.kernels.cpu.ops import NORM_MODES, MambaDecodeParams

SOURCE = Path(__file__).with_name("verify.c")
MAX_TOKENS, MAX_STATE, MAX_CONV_KERNEL = 64, 512, 64  # the C file's limits


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: CPU verify steps run the torch path."""
    return cpu_library()


def mamba_verify_supported(
    zxbcdt: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor, q: int
) -> bool:
    """CPU tensors on the torch backend within the C file's limits."""
    return (
        zxbcdt.device.type == "cpu"
        and select_backend(zxbcdt) == "torch"
        and zxbcdt.dtype in (torch.float32, torch.bfloat16)
        and conv_states.dtype == zxbcdt.dtype
        and ssm_states.dtype == torch.float32
        and zxbcdt.stride(1) == 1
        and conv_states.is_contiguous()
        and ssm_states.is_contiguous()
        and q <= MAX_TOKENS
        and ssm_states.shape[-1] <= MAX_STATE
        and conv_states.shape[-1] < MAX_CONV_KERNEL
        and library() is not None
    )


def mamba_verify_cpu(
    zxbcdt: torch.Tensor,
    conv_states: torch.Tensor,
    ssm_states: torch.Tensor,
    state_indices: torch.Tensor,
    params: MambaDecodeParams,
    dt_limit: tuple[float, float],
    eps: float,
    *,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    d_state: int,
    norm_group: int,
    norm_mode: str,
) -> torch.Tensor:
    """zxbcdt: (batch * q, I + conv_dim + H) in_proj rows, request b's q tokens consecutive;
    state_indices: (batch, q + 1) int64 (column 0 read, column i + 1 gets the state after token
    i, for the conv window and the SSM state alike). Returns (batch * q, I) in the model dtype:
    the out_proj input, as q fused decode steps (baton.kernels.cpu.ops.mamba_decode_cpu) would give."""
    batch, q1 = state_indices.shape
    q = q1 - 1
    intermediate = num_heads * head_dim
    conv_dim = intermediate + 2 * n_groups * d_state
    rows = batch * q
    K = params.conv_weight.shape[1]
    slots = state_indices.to(torch.int64).contiguous()
    xbc = torch.empty(rows, conv_dim, dtype=torch.float32)
    y = torch.empty(rows, intermediate, dtype=torch.float32)
    out = torch.empty(rows, intermediate, dtype=zxbcdt.dtype)
    result = library().baton_mamba_verify(
        zxbcdt,
        zxbcdt.stride(0),
        conv_states,
        ssm_states,
        ssm_states.shape[0],
        slots,
        batch,
        q,
        params.conv_weight,
        params.conv_bias,
        params.dt_bias,
        params.A,
        params.D,
        dt_limit[0],
        min(dt_limit[1], 3.0e38),
        params.norm_weight,
        eps,
        xbc,
        y,
        out,
        int(zxbcdt.dtype == torch.bfloat16),
        intermediate,
        num_heads,
        head_dim,
        d_state,
        n_groups,
        K,
        norm_group,
        NORM_MODES[norm_mode],
        torch.get_num_threads(),
    )
    if result < 0:
        raise ValueError(
            "mamba_verify: shapes past the C step's limits (see mamba_verify_supported)"
        )
    if result:
        entry = result - 1
        raise IndexError(
            f"mamba_verify: slot index {int(slots.view(-1)[entry])} at table entry {entry} is "
            f"outside the pool of {ssm_states.shape[0]}"
        )
    return out
