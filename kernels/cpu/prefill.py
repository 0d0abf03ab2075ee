"""Fused CPU prefill scan (kernels/cpu/prefill.c), compiled once per machine into the
operator extension (kernels/cpu/extension.py).

The torch SSD path (kernels/ssd.py) pads every sequence to the longest one's chunk count, builds
two segment-sum masks and permutes its operands for the einsums; on the 110M config that was
~20% of an offline run. The C scan walks each sequence's packed tokens per head with the state
held in the pool slot itself, so the gather of initial states and the scatter of final states
disappear too. Built and cached like kernels/cpu/ops.py (same flags, `$BATON_CACHE_DIR`, keyed by
source, flags, compiler and CPU); `BATON_CPU_OPS=0`, no compiler, a failed build or a state pool
that is not contiguous float32 select the torch path, which agrees to float32 rounding
(tests/test_cpu_prefill.py).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

from baton.kernels.backend import select_backend
from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("prefill.c")
MAX_CHUNK = 1024  # the C scan keeps two chunk-length float arrays on each thread's stack


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: CPU prefill runs the (slower) torch SSD path."""
    return cpu_library()


def supported(x: torch.Tensor, ssm_pool: torch.Tensor, chunk_size: int) -> bool:
    return (
        x.device.type == "cpu"
        and select_backend(x) == "torch"
        and ssm_pool.dtype == torch.float32
        and ssm_pool.is_contiguous()
        and 0 < chunk_size <= MAX_CHUNK
        and library() is not None
    )


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t (T, a, b) as float32 whose rows may be strided but whose (a, b) part is dense: the
    conv output's x / B / C views in a float32 model pass without a copy."""
    t = t.float()
    if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) < t.shape[1] * t.shape[2]:
        t = t.contiguous()
    return t


def ssd_prefill_cpu(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    ssm_pool: torch.Tensor,
    slots: torch.Tensor,
    cu_seqlens: torch.Tensor,
    start_pos: torch.Tensor,
    chunk_size: int,
    num_chunks: int | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked scan of baton.kernels.ssd.ssd_scan_torch with `dt` already discretised (float32,
    (T, H)). Reads each sequence's initial state from `ssm_pool[slots[s]]` and leaves its final
    state there. Returns y (T, H, P) in x's dtype, and when `num_chunks` is given the float32
    state after each aligned chunk, (S, num_chunks, H, P, N) (chunks past a sequence's end hold
    its final state)."""
    T, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    S = slots.shape[0]
    xf, Bf, Cf = _rows(x), _rows(B), _rows(C)
    if Bf.stride(0) != Cf.stride(0):
        Bf, Cf = Bf.contiguous(), Cf.contiguous()
    dtf = dt.float().contiguous()
    Af, Df = A.float().contiguous(), D.float().contiguous()
    slots64 = slots.to(torch.int64).contiguous()
    cu = cu_seqlens.to(torch.int64).contiguous()
    starts = start_pos.to(torch.int64).contiguous()
    y = torch.empty(T, H, P, dtype=torch.float32)
    chunk_states = None
    if num_chunks is not None:
        chunk_states = torch.empty(S, num_chunks, H, P, N, dtype=torch.float32)
    result = library().baton_ssd_prefill(
        xf,
        xf.stride(0),
        Bf,
        Cf,
        Bf.stride(0),
        dtf,
        Af,
        Df,
        ssm_pool,
        ssm_pool.shape[0],
        slots64,
        cu,
        starts,
        S,
        y,
        chunk_states,
        num_chunks or 0,
        H,
        P,
        N,
        G,
        chunk_size,
        torch.get_num_threads(),
    )
    if result:
        row = result - 1
        raise IndexError(
            f"ssd prefill: slot index {int(slots64[row])} of sequence {row} is outside the pool "
            f"of {ssm_pool.shape[0]}"
        )
    return y.to(x.dtype), chunk_states


def gated_norm_supported(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        y.device.type == "cpu"
        and select_backend(y) == "torch"
        and y.dtype in (torch.float32, torch.bfloat16)
        and z.dtype == y.dtype
        and weight.dtype == y.dtype
        and y.dim() == 2
        and y.stride(1) == 1
        and z.stride(1) == 1
        and weight.is_contiguous()
        and library() is not None
    )


def gated_rms_norm_cpu(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """Same contract and rounding as baton.kernels.norm.gated_rms_norm_torch (y, z: (T, I) rows that
    may be strided, e.g. z a view of in_proj's output; weight (I,) in y's dtype)."""
    T, width = y.shape
    if width % group_size:
        raise ValueError(f"gated norm: width {width} is not a multiple of the group {group_size}")
    out = torch.empty(T, width, dtype=y.dtype)
    library().baton_gated_norm(
        y,
        y.stride(0),
        z,
        z.stride(0),
        weight,
        out,
        T,
        width,
        group_size,
        eps,
        int(y.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


MAX_CONV_KERNEL = 16  # CONV_MAX_K in cpu/prefill.c


def conv_supported(x: torch.Tensor, conv_states: torch.Tensor, kernel: int) -> bool:
    return (
        x.device.type == "cpu"
        and select_backend(x) == "torch"
        and x.dtype in (torch.float32, torch.bfloat16)
        and conv_states.dtype == x.dtype
        and conv_states.is_contiguous()
        and x.dim() == 2
        and x.stride(1) == 1
        and 2 <= kernel <= MAX_CONV_KERNEL
        and library() is not None
    )


def causal_conv1d_varlen_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    layout,
    window_tokens: torch.Tensor | None = None,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as baton.kernels.conv1d.causal_conv1d_varlen_torch (layout: its ConvLayout;
    the sequence lengths are read back from `final_columns`)."""
    T, dim = x.shape
    K = weight.shape[1]
    S = layout.num_seqs
    # final_columns[s, 0] = s * width + len(s): the layout's lengths without another field
    lens = layout.final_columns[:, 0].cpu() - torch.arange(S) * layout.width
    cu = torch.zeros(S + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lens, 0)
    slots = state_indices.to(torch.int64).contiguous()
    out = torch.empty(T, dim, dtype=x.dtype)
    windows = window_of_token = None
    if window_tokens is not None:
        windows = torch.empty(window_tokens.shape[0], dim, K - 1, dtype=x.dtype)
        window_of_token = torch.full((T,), -1, dtype=torch.int64)
        window_of_token[window_tokens] = torch.arange(window_tokens.shape[0])
    wf = weight.float().contiguous()
    bf = bias.float().contiguous() if bias is not None else None
    result = library().baton_conv_varlen(
        x,
        x.stride(0),
        wf,
        bf,
        conv_states,
        conv_states.shape[0],
        slots,
        cu,
        S,
        out,
        window_of_token,
        windows,
        dim,
        K,
        int(x.dtype == torch.bfloat16),
        int(activation == "silu"),
        torch.get_num_threads(),
    )
    if result:
        row = result - 1
        raise IndexError(
            f"conv prefill: slot index {int(slots[row])} of sequence {row} is outside the pool "
            f"of {conv_states.shape[0]}"
        )
    return out, windows
