"""Gated delta rule on the CPU (kernels/cpu/gated_delta.c), compiled once per machine into
the operator extension (kernels/cpu/extension.py).

Three entry points over one C recurrence (per (sequence, v head, block of 32 state columns),
the block held in L1 across the tokens): the threaded prefill scan on pool slots with chunk-end
states, the plain decode step, and the fused decode step of a whole gated DeltaNet mixer (conv,
gating, the rule and the gated norm; the GDN analogue of cpu_ops.mamba_decode_cpu). Built and
cached like kernels/cpu/ops.py (`$BATON_CACHE_DIR`, keyed by source, flags, compiler and CPU);
`BATON_CPU_OPS=0`, no compiler, a failed build or a pool that is not contiguous float32 select the
torch path (kernels/gated_delta.py), which agrees to float32 rounding (tests/test_gated_delta_cpu.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import torch

from baton.kernels.backend import select_backend
from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library
from baton.kernels.layouts import ChunkLayout

SOURCE = Path(__file__).with_name("gated_delta.c")


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: the gated delta rule runs its (slower) torch path."""
    return cpu_library()


def supported(v: torch.Tensor, state_pool: torch.Tensor) -> bool:
    """CPU tensors on the torch backend with a contiguous float32 pool and the library built."""
    return (
        v.device.type == "cpu"
        and select_backend(v) == "torch"
        and state_pool.dtype == torch.float32
        and state_pool.is_contiguous()
        and library() is not None
    )


def f32c(t: torch.Tensor) -> torch.Tensor:
    """`t` as the C kernels read it: float32, contiguous."""
    return t.to(torch.float32).contiguous()


def raise_bad_slot(result: int, slots: torch.Tensor, num_slots: int, what: str) -> None:
    """A slot kernel's error code (1 + the row whose slot is outside the pool) as an IndexError."""
    if result:
        row = result - 1
        raise IndexError(
            f"{what}: slot index {int(slots[row])} of row {row} is outside the pool of {num_slots}"
        )


def _scan(q, k, v, g, beta, state_pool, slots, cu, start_pos, chunk, chunk_states, skip_padding):
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1:]
    slots64 = slots.to(torch.int64).contiguous()
    o = torch.empty(T, Hv, dv, dtype=torch.float32)
    qkn = torch.empty(T, Hk, 2 * dk + 1, dtype=torch.float32)
    qf, kf, vf, gf, bf = (f32c(t) for t in (q, k, v, g, beta))
    result = library().baton_gdn_scan(
        qf,
        kf,
        vf,
        gf,
        bf,
        state_pool,
        state_pool.shape[0],
        slots64,
        cu,
        start_pos,
        slots64.shape[0],
        chunk,
        chunk_states,
        chunk_states.shape[1] if chunk_states is not None else 0,
        int(skip_padding),
        qkn,
        o,
        Hk,
        Hv,
        dk,
        dv,
        torch.get_num_threads(),
    )
    raise_bad_slot(result, slots64, state_pool.shape[0], "gated delta rule")
    return o.to(v.dtype)


def gated_delta_prefill_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    layout: ChunkLayout,
    want_chunk_states: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as baton.kernels.gated_delta.gated_delta_prefill (shapes checked there)."""
    Hv, dk, dv = state_pool.shape[1:]
    chunk_states = None
    if want_chunk_states:
        chunk_states = torch.empty(layout.num_seqs, layout.num_chunks, Hv, dk, dv)
    cu = layout.cu_seqlens.to(torch.int64).contiguous()
    start_pos = layout.start_pos.to(torch.int64).contiguous()
    o = _scan(
        q, k, v, g, beta, state_pool, state_indices, cu, start_pos, layout.chunk_size,
        chunk_states, skip_padding=False,
    )  # fmt: skip
    return o, chunk_states


def gated_delta_decode_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Same contract as baton.kernels.gated_delta.gated_delta_decode (shapes checked there)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int64)
    return _scan(q, k, v, g, beta, state_pool, state_indices, cu, None, 0, None, True)


class GDNDecodeParams(NamedTuple):
    """A gated DeltaNet mixer's small parameters as the fused decode step reads them (float32,
    contiguous)."""

    conv_weight: torch.Tensor  # (conv_dim, K), conv_dim = 2 Hk dk + Hv dv, no bias
    A: torch.Tensor  # (Hv,) = -exp(A_log)
    dt_bias: torch.Tensor  # (Hv,)
    norm_weight: torch.Tensor  # (dv,) the output norm's plain weight


def gdn_decode_supported(
    qkv: torch.Tensor, conv_states: torch.Tensor, state_pool: torch.Tensor
) -> bool:
    """CPU rows in float32 or bfloat16 on the torch backend, pools as the kernel reads them."""
    return (
        qkv.device.type == "cpu"
        and select_backend(qkv) == "torch"
        and qkv.dtype in (torch.float32, torch.bfloat16)
        and conv_states.dtype == qkv.dtype
        and conv_states.is_contiguous()
        and supported(qkv, state_pool)
    )


def gdn_decode_cpu(
    qkv: torch.Tensor,
    z: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_states: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    params: GDNDecodeParams,
    *,
    beta_scale: float,
    eps: float,
    num_k_heads: int,
) -> torch.Tensor:
    """One fused gated DeltaNet decode step (baton_gdn_decode), both pools updated in place.

    qkv: (batch, 2 Hk dk + Hv dv) in_proj rows [q | k | v] before the conv; z: (batch, Hv dv)
    the gate; a, b: (batch, Hv) the decay and beta projections (a and b share a row stride);
    all in the model dtype (float32 or bfloat16) with unit column stride (views are fine).
    conv_states: (num_slots, conv_dim, K-1) model dtype; state_pool: (num_slots, Hv, dk, dv)
    float32; state_indices: (batch,) int64, 0 for padding rows (nothing written, output 0).
    Returns (batch, Hv dv) in the model dtype: the out_proj input. Same result as conv1d's
    update + gdn_gating + gated_delta_decode + the norm-before-gate to float32 rounding."""
    batch = qkv.shape[0]
    Hv, dk, dv = state_pool.shape[1:]
    conv_dim = 2 * num_k_heads * dk + Hv * dv
    K = params.conv_weight.shape[1]
    for name, t, width in (("qkv", qkv, conv_dim), ("z", z, Hv * dv), ("a", a, Hv), ("b", b, Hv)):
        if t.shape != (batch, width) or t.dtype != qkv.dtype or (width > 1 and t.stride(1) != 1):
            raise ValueError(
                f"gdn_decode: {name} must be ({batch}, {width}) {qkv.dtype} rows with unit column "
                f"stride, got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )
    if a.stride(0) != b.stride(0):
        raise ValueError(
            f"gdn_decode: a and b must share a row stride, got {a.stride()}, {b.stride()}"
        )
    if conv_states.shape[1:] != (conv_dim, K - 1):
        raise ValueError(f"gdn_decode: conv_states must be (num_slots, {conv_dim}, {K - 1}), "
                         f"got {tuple(conv_states.shape)}")  # fmt: skip
    slots = state_indices.to(torch.int64).contiguous()
    xconv = torch.empty(batch, conv_dim, dtype=torch.float32)
    qkn = torch.empty(batch, num_k_heads, 2 * dk + 1, dtype=torch.float32)
    o = torch.empty(batch, Hv * dv, dtype=torch.float32)
    out = torch.empty(batch, Hv * dv, dtype=qkv.dtype)
    result = library().baton_gdn_decode(
        qkv,
        qkv.stride(0),
        z,
        z.stride(0),
        a,
        b,
        a.stride(0),
        conv_states,
        state_pool,
        state_pool.shape[0],
        slots,
        batch,
        params.conv_weight,
        K,
        params.A,
        params.dt_bias,
        beta_scale,
        params.norm_weight,
        eps,
        xconv,
        qkn,
        o,
        out,
        int(qkv.dtype == torch.bfloat16),
        num_k_heads,
        Hv,
        dk,
        dv,
        torch.get_num_threads(),
    )
    raise_bad_slot(result, slots, state_pool.shape[0], "gdn_decode")
    return out
