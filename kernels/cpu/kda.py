"""Kimi Delta Attention on the CPU (kernels/cpu/kda.c), compiled once per machine into
the operator extension (kernels/cpu/extension.py).

Two entry points over one C recurrence (per (sequence, head, block of 32 state columns), the block
held in L1 across the tokens): the threaded scan on pool slots with chunk-end states (prefill,
and the plain decode step), and the fused decode step of a whole KDA mixer (conv, decay and beta,
the rule and the gated norm). `BATON_CPU_OPS=0`, no compiler, a failed build or a pool that is not contiguous float32 select the
torch path (kernels/kda.py), which agrees to float32 rounding (tests/test_kimi_kernels.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import NamedTuple

import torch

from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library

# one library, one pool contract: the gated delta rule's checks serve KDA's kernels as they are
from baton.kernels.cpu.gated_delta import f32c, raise_bad_slot, supported
from baton.kernels.layouts import ChunkLayout

SOURCE = Path(__file__).with_name("kda.c")
MAX_HEAD_DIM = 1024  # the fused decode step's per-head decay buffer


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: KDA runs its
    (slower) torch path."""
    return cpu_library()


def _scan(q, k, v, g, beta, state_pool, slots, cu, start_pos, chunk, chunk_states, skip_padding):
    T, H, dk = q.shape
    dv = v.shape[-1]
    slots64 = slots.to(torch.int64).contiguous()
    o = torch.empty(T, H, dv, dtype=torch.float32)
    prep = torch.empty(T, H, 4 * dk + 1, dtype=torch.float32)
    qf, kf, vf, gf, bf = (f32c(t) for t in (q, k, v, g, beta))
    result = library().baton_kda_scan(
        qf, kf, vf, gf, bf,
        state_pool, state_pool.shape[0], slots64, cu,
        start_pos, slots64.shape[0], chunk,
        chunk_states,
        chunk_states.shape[1] if chunk_states is not None else 0, int(skip_padding),
        prep, o, H, dk, dv, torch.get_num_threads(),
    )  # fmt: skip
    raise_bad_slot(result, slots64, state_pool.shape[0], "KDA")
    return o.to(v.dtype)


def kda_prefill_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as baton.kernels.kda.kda_prefill (shapes checked there): (o, chunk_states
    (num_seqs, num_chunks, H, dk, dv) float32)."""
    H, dk, dv = state_pool.shape[1:]
    chunk_states = torch.empty(layout.num_seqs, layout.num_chunks, H, dk, dv)
    cu = layout.cu_seqlens.to(torch.int64).contiguous()
    start_pos = layout.start_pos.to(torch.int64).contiguous()
    o = _scan(
        q, k, v, g, beta, state_pool, state_indices, cu, start_pos, layout.chunk_size,
        chunk_states, skip_padding=False,
    )  # fmt: skip
    return o, chunk_states


def kda_decode_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Same contract as baton.kernels.kda.kda_decode (shapes checked there)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int64)
    return _scan(q, k, v, g, beta, state_pool, state_indices, cu, None, 0, None, True)


class KDADecodeParams(NamedTuple):
    """A KDA mixer's small parameters as the fused decode step reads them (float32,
    contiguous)."""

    conv_weight: torch.Tensor  # (3 H d, K), no bias
    A: torch.Tensor  # (H,) = -exp(A_log)
    dt_bias: torch.Tensor  # (H d,)
    norm_weight: torch.Tensor  # (d,) the gated output norm's weight


def kda_mixer_decode_supported(
    qkv: torch.Tensor, conv_states: torch.Tensor, state_pool: torch.Tensor
) -> bool:
    """CPU rows in float32 or bfloat16 on the torch backend, pools as the kernel reads them."""
    return (
        qkv.device.type == "cpu"
        and qkv.dtype in (torch.float32, torch.bfloat16)
        and conv_states.dtype == qkv.dtype
        and conv_states.is_contiguous()
        and state_pool.shape[-1] <= MAX_HEAD_DIM
        and supported(qkv, state_pool)
    )


def kda_mixer_decode_cpu(
    qkv: torch.Tensor,
    f: torch.Tensor,
    b: torch.Tensor,
    gate: torch.Tensor,
    conv_states: torch.Tensor,
    state_pool: torch.Tensor,
    state_indices: torch.Tensor,
    params: KDADecodeParams,
    *,
    eps: float,
    gate_lower_bound: float | None,
) -> torch.Tensor:
    """One fused KDA decode step (baton_kda_decode), both pools updated in place.

    qkv: (batch, 3 H d) projection rows [q | k | v] before the conv; f: (batch, H d) the decay
    projection (f_b_proj's output); b: (batch, H); gate: (batch, H d) the output gate; all in
    the model dtype (float32 or bfloat16) with unit column stride (views are fine).
    conv_states: (num_slots, 3 H d, K-1) model dtype; state_pool: (num_slots, H, d, d) float32;
    state_indices: (batch,) int64, 0 for padding rows (nothing written, output 0);
    gate_lower_bound: None for the softplus decay, else Bailing's bound. Returns
    (batch, H d) in the model dtype: the o_proj input (kernels/kda_mixer.py's, to float32
    rounding)."""
    batch = qkv.shape[0]
    H, d = state_pool.shape[1:3]
    K = params.conv_weight.shape[1]
    for name, t, width in (("qkv", qkv, 3 * H * d), ("f", f, H * d), ("b", b, H),
                           ("gate", gate, H * d)):  # fmt: skip
        if t.shape != (batch, width) or t.dtype != qkv.dtype or (width > 1 and t.stride(1) != 1):
            raise ValueError(
                f"kda_decode: {name} must be ({batch}, {width}) {qkv.dtype} rows with unit column "
                f"stride, got {tuple(t.shape)} {t.dtype} strides {t.stride()}"
            )
    if conv_states.shape[1:] != (3 * H * d, K - 1):
        raise ValueError(f"kda_decode: conv_states must be (num_slots, {3 * H * d}, {K - 1}), "
                         f"got {tuple(conv_states.shape)}")  # fmt: skip
    slots = state_indices.to(torch.int64).contiguous()
    xconv = torch.empty(batch, 3 * H * d, dtype=torch.float32)
    prep = torch.empty(batch, H, 4 * d + 1, dtype=torch.float32)
    o = torch.empty(batch, H * d, dtype=torch.float32)
    out = torch.empty(batch, H * d, dtype=qkv.dtype)
    result = library().baton_kda_decode(
        qkv, qkv.stride(0), f, f.stride(0), b, b.stride(0),
        gate, gate.stride(0), conv_states, state_pool,
        state_pool.shape[0], slots, batch, params.conv_weight, K,
        params.A, params.dt_bias, int(gate_lower_bound is not None),
        gate_lower_bound or 0.0, params.norm_weight, eps,
        xconv, prep, o, out,
        int(qkv.dtype == torch.bfloat16), H, d, torch.get_num_threads(),
    )  # fmt: skip
    raise_bad_slot(result, slots, state_pool.shape[0], "kda_decode")
    return out
