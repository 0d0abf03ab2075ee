"""Fused CPU decode kernels (kernels/cpu/ops.c), torch operators of baton's C++ extension.

The torch path of a decode step reads and writes each Mamba state several times (gather,
scale, outer-product add, scatter, reduce); at batch 64 of the ~110M config that is ~15 ms per
layer for what one in-place pass does in ~2 ms. The C file has no torch headers; the extension
(kernels/cpu/extension.py) compiles it with the others and makes each kernel an operator,
built once per machine and cached under `$BATON_CACHE_DIR` (default ~/.cache/baton). Without a
compiler, with `BATON_CPU_OPS=0`, or for dtypes the kernels do not take, the torch path runs
instead; the two agree to float32 rounding (tests/test_kernels_torch.py).

The operators release the GIL while they run; the loops use OpenMP with torch's thread count.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from baton.kernels.backend import select_backend
from baton.kernels.cpu.extension import Kernels, cpu_key, enabled
from baton.kernels.cpu.extension import library as cpu_library

MAX_CONV_KERNEL = 64

__all__ = ["cpu_key", "enabled", "library"]


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: CPU decode runs the (slower) torch path."""
    return cpu_library()


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32).contiguous()


def _check(result: int, slots: torch.Tensor, num_slots: int, what: str) -> None:
    if result:
        row = result - 1
        raise IndexError(
            f"{what}: slot index {int(slots[row])} of row {row} is outside the pool of {num_slots}"
        )


def ssu_supported(ssm_states: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and ssm_states.dtype == torch.float32
        and ssm_states.is_contiguous()
        and library() is not None
    )


def selective_state_update_cpu(
    ssm_states: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state_indices: torch.Tensor,
) -> torch.Tensor:
    """Same contract as baton.kernels.ssu.selective_state_update_torch, with `dt` already discretized
    (float32). Updates `ssm_states` in place; returns y in x's dtype."""
    batch, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    xf, dtf, Bf, Cf = _f32(x), _f32(dt), _f32(B), _f32(C)
    Af, Df = _f32(A), _f32(D)
    slots = state_indices.to(torch.int64).contiguous()
    y = torch.empty(batch, H, P, dtype=torch.float32)
    result = library().baton_ssu_f32(
        ssm_states,
        ssm_states.shape[0],
        slots,
        batch,
        xf,
        dtf,
        Af,
        Bf,
        Cf,
        Df,
        y,
        H,
        P,
        N,
        G,
        torch.get_num_threads(),
    )
    _check(result, slots, ssm_states.shape[0], "selective_state_update")
    return y.to(x.dtype)


def conv_update_supported(conv_states: torch.Tensor, x: torch.Tensor, kernel: int) -> bool:
    return (
        x.device.type == "cpu"
        and conv_states.dtype in (torch.float32, torch.bfloat16)
        and conv_states.is_contiguous()
        and kernel <= MAX_CONV_KERNEL
        and library() is not None
    )


def causal_conv1d_update_cpu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    activation: str = "silu",
) -> torch.Tensor:
    """Same contract as baton.kernels.conv1d.causal_conv1d_update_torch (fp32 arithmetic)."""
    batch, dim = x.shape
    K = weight.shape[1]
    xf, wf = _f32(x), _f32(weight)
    bf = _f32(bias) if bias is not None else torch.zeros(dim)
    slots = state_indices.to(torch.int64).contiguous()
    out = torch.empty(batch, dim, dtype=torch.float32)
    result = library().baton_conv_update(
        conv_states,
        int(conv_states.dtype == torch.bfloat16),
        conv_states.shape[0],
        slots,
        batch,
        xf,
        wf,
        bf,
        out,
        dim,
        K,
        int(activation == "silu"),
        torch.get_num_threads(),
    )
    _check(result, slots, conv_states.shape[0], "causal_conv1d_update")
    return out.to(x.dtype)


# Up to this many logits torch's argmax beats a call into the library (~5 us against ~20 us at
# 1 x 494; level at ~3 x 4096, where the library's threads start to pay).
_SMALL_ARGMAX = 4096


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for a (rows, vocab) float32 CPU tensor, rows spread over threads
    (torch's kernel runs ~1 ms on one core for 64 x 32000). Rows holding NaN go to torch, which
    ranks NaN highest."""
    lib = library()
    if (
        lib is None
        or logits.numel() <= _SMALL_ARGMAX  # torch's is quicker than a call into the library
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.shape[1] == 0
        or logits.stride(1) != 1
    ):
        return logits.argmax(dim=-1)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.baton_argmax_f32(logits, rows, cols, logits.stride(0), out, torch.get_num_threads())
    bad = out >= cols  # no element equals the max: the row has a NaN
    if bool(bad.any()):
        out[bad] = logits[bad].argmax(dim=-1)
    return out


NORM_MODES = {"gated": 0, "norm_then_gate": 1, "none": 2}  # baton_mamba_decode's norm_mode


class MambaDecodeParams(NamedTuple):
    """A Mamba2 mixer's small parameters as the fused decode step reads them (float32)."""

    conv_weight: torch.Tensor  # (conv_dim, K)
    conv_bias: torch.Tensor  # (conv_dim,), zeros when the conv has no bias
    dt_bias: torch.Tensor  # (H,)
    A: torch.Tensor  # (H,) = -exp(A_log)
    D: torch.Tensor  # (H,)
    norm_weight: torch.Tensor  # (intermediate,)


def mamba_decode_supported(zxbcdt: torch.Tensor, conv_states: torch.Tensor, ssm_states) -> bool:
    """CPU tensors on the torch backend (BATON_KERNELS=triton runs the Triton kernels instead)."""
    return (
        zxbcdt.device.type == "cpu"
        and select_backend(zxbcdt) == "torch"
        and zxbcdt.dtype in (torch.float32, torch.bfloat16)
        and conv_states.dtype == zxbcdt.dtype
        and ssm_states.dtype == torch.float32
        and zxbcdt.stride(1) == 1
        and conv_states.is_contiguous()
        and ssm_states.is_contiguous()
        and library() is not None
    )


def mamba_decode_cpu(
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
    norm_mode: str = "gated",
) -> torch.Tensor:
    """One fused Mamba2 decode step (kernels/cpu/ops.c: baton_mamba_decode): conv + SiLU, dt,
    selective state update and the gate with the grouped RMS norm, pools updated in place.
    norm_mode (baton.engine.config.MambaNorm): "gated" norm(y * silu(z)), "norm_then_gate"
    norm(y) * silu(z), "none" y * silu(z) (params.norm_weight is then unused).

    zxbcdt: (batch, I + conv_dim + H) in_proj output rows (model dtype, unit column stride);
    returns (batch, I) in the model dtype: the out_proj input. Same result as
    causal_conv1d_update + selective_state_update + gated_rms_norm to float32 rounding."""
    batch = zxbcdt.shape[0]
    intermediate = num_heads * head_dim
    conv_dim = intermediate + 2 * n_groups * d_state
    K = params.conv_weight.shape[1]
    slots = state_indices.to(torch.int64).contiguous()
    xbc = torch.empty(batch, conv_dim, dtype=torch.float32)
    y = torch.empty(batch, intermediate, dtype=torch.float32)
    out = torch.empty(batch, intermediate, dtype=zxbcdt.dtype)
    result = library().baton_mamba_decode(
        zxbcdt,
        zxbcdt.stride(0),
        conv_states,
        ssm_states,
        ssm_states.shape[0],
        slots,
        batch,
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
    _check(result, slots, ssm_states.shape[0], "mamba_decode")
    return out


def silu_mul_supported(gate_up: torch.Tensor) -> bool:
    return (
        gate_up.device.type == "cpu"
        and gate_up.dim() == 2
        and gate_up.dtype in (torch.float32, torch.bfloat16)
        and gate_up.stride(-1) == 1
        and library() is not None
    )


def silu_mul_cpu(gate_up: torch.Tensor, gate_multiplier: float = 1.0) -> torch.Tensor:
    """up * silu(gate * gate_multiplier) for gate_up (rows, 2 * inter) = [gate | up], rounded
    op by op to its dtype as the torch expression would be. Returns (rows, inter)."""
    rows, width = gate_up.shape
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype)
    library().baton_silu_mul(
        gate_up,
        gate_up.stride(0),
        out,
        rows,
        inter,
        gate_multiplier,
        int(gate_up.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


def rms_norm_supported(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.stride(1) == 1
        and library() is not None
    )


def rms_norm_cpu(x: torch.Tensor, weight_f32: torch.Tensor, eps: float) -> torch.Tensor:
    """baton.kernels.norm.rms_norm_torch in one pass; `weight_f32` float32 contiguous."""
    rows, hidden = x.shape
    out = torch.empty(rows, hidden, dtype=x.dtype)
    library().baton_rms_norm(
        x,
        x.stride(0),
        weight_f32,
        out,
        rows,
        hidden,
        eps,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
    return out


MAX_ROTARY_HALF = 256  # cos / sin entries a token's rotation keeps on the stack (ops.c)


def rotary_store_supported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, cos: torch.Tensor
) -> bool:
    """Whether baton_rotary_store_kv runs this step: CPU tensors of one float32 / bfloat16
    dtype, each token's heads contiguous, at most MAX_ROTARY_HALF rotated pairs."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k.dtype == v.dtype == k_cache.dtype == q.dtype
        and all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (q, k, v))
        and cos.shape[1] <= MAX_ROTARY_HALF
        and library() is not None
    )


def rotary_store_kv_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """kernels/attention.py's rotary_store_kv_torch in one pass (same roundings): q (T, H, Dh),
    k, v (T, KVH, Dh) with contiguous heads; cos, sin (T, half) float32. Stores the rotated k and
    v at `slot_mapping`; returns the rotated q (T, H, Dh), a new tensor."""
    T, H, Dh = q.shape
    out = torch.empty(T, H, Dh, dtype=q.dtype)
    slots = slot_mapping.to(torch.int64).contiguous()
    result = library().baton_rotary_store_kv(
        q, q.stride(0), k, k.stride(0), v, v.stride(0), _f32(cos), _f32(sin), cos.shape[1],
        out, k_cache, v_cache, k_cache.shape[0], slots, T, H, k.shape[1], Dh,
        int(q.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    _check(result, slots, k_cache.shape[0], "rotary_store_kv")
    return out


MAX_HEAD_DIM = 512  # the per-thread accumulators in baton_decode_attention


def decode_attention_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        q.device.type == "cpu"
        and select_backend(q) == "torch"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k_cache.dtype == q.dtype
        and q.shape[-1] <= MAX_HEAD_DIM
        and library() is not None
    )


def decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over the paged cache. q: (S, H, Dh); caches (slots, KVH, Dh);
    kv_indices (S, >= max len) int64; kv_lens (S,) int32. Returns (S, H, Dh) in q's dtype."""
    return _attention_rows(q, k_cache, v_cache, kv_indices, kv_lens, None, scale)


def extend_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of packed queries over the paged cache (their own K/V stored already):
    sequence s's queries are rows query_start_loc[s]..[s + 1] of q (T, H, Dh), its last tokens
    of kv_lens[s]. window > 0: each query sees only the last `window` keys up to its own
    position (sliding-window attention: the slots behind a window are never read). Returns
    (T, H, Dh) in q's dtype; float32 arithmetic, like decode's."""
    return _attention_rows(q, k_cache, v_cache, kv_indices, kv_lens, query_start_loc, scale, window)


def _attention_rows(q, k_cache, v_cache, kv_indices, kv_lens, query_start_loc, scale, window=0):
    T, H, Dh = q.shape
    S = kv_lens.shape[0]
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    kv_lens = kv_lens.to(torch.int32).contiguous()
    if kv_indices.stride(-1) != 1:
        kv_indices = kv_indices.contiguous()
    out = torch.empty(T, H, Dh, dtype=q.dtype)
    common = (
        q,
        k_cache,
        v_cache,
        k_cache.shape[0],
        kv_indices,
        kv_indices.stride(0),
        kv_lens,
    )
    shape = (H, k_cache.shape[1], Dh, scale)
    tail = (int(q.dtype == torch.bfloat16), torch.get_num_threads())
    if query_start_loc is None:
        result = library().baton_decode_attention(*common, out, S, *shape, *tail)
    else:
        cu = query_start_loc.to(torch.int32).contiguous()
        result = library().baton_extend_attention(*common, cu, out, T, S, *shape, window, *tail)
    if result == -1:
        raise MemoryError("attention: no memory for the per-thread score buffers")
    if result == -2:
        raise ValueError("attention: query offsets or lengths do not fit the sequences' kv_lens")
    if result:
        raise IndexError(f"attention: sequence {result - 1} has a token slot outside the cache")
    return out
