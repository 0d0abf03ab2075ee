"""Fused CPU decode kernels (kernels/cpu/ops.c), compiled once per machine and loaded by ctypes.

The torch path of a decode step reads and writes each Mamba state several times (gather,
scale, outer-product add, scatter, reduce); at batch 64 of the ~110M config that is ~15 ms per
layer for what one in-place pass does in ~2 ms. The C file is small and has no torch headers, so
the first use builds it with the system C compiler in about a second; the shared object is
cached under `$BATON_CACHE_DIR` (default ~/.cache/baton), keyed by the source, the flags and
the CPU. Without a compiler, with `BATON_CPU_OPS=0`, or for dtypes the kernels do not take, the
torch path runs instead; the two agree to float32 rounding (tests/test_kernels_torch.py).

ctypes releases the GIL for the call; the loops use OpenMP with torch's thread count.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from baton.kernels.backend import select_backend
from baton.kernels.machine_cache import cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("ops.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
MAX_CONV_KERNEL = 64

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


def enabled() -> bool:
    return os.environ.get("BATON_CPU_OPS", "1").strip() not in ("0", "false", "no")


def cpu_key() -> str:
    """This CPU's feature flags (/proc/cpuinfo): what a build or a timing made here is valid for."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return flags


def _build(source: Path, target: Path, compiler: str) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run(
            [compiler, *FLAGS, str(source), "-o", str(out), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        os.replace(out, target)  # atomic: concurrent builders race harmlessly


def compile_library(source: Path, fallback: str) -> ctypes.CDLL | None:
    """Build `source` once per machine (cached in $BATON_CACHE_DIR, keyed by the source, flags,
    compiler and CPU) and load it; None, with one warning naming `fallback`, when disabled, no
    compiler is found or the build fails."""
    if not enabled():
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: %s", fallback)
        return None
    # The headers beside the source (cpu/common.h) are part of what gets compiled.
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = hashlib.sha256(
        source.read_bytes()
        + headers
        + " ".join(FLAGS).encode()
        + compiler.encode()
        + cpu_key().encode()
    ).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    try:
        if not target.exists():
            _build(source, target, compiler)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        log.warning("building %s failed (%s): %s", source.name, fallback, detail)
        return None


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (no compiler, build failed, or disabled)."""
    lib = compile_library(SOURCE, "CPU decode runs the (slower) torch path")
    if lib is None:
        return None
    lib.baton_ssu_f32.restype = _i64
    lib.baton_ssu_f32.argtypes = [_ptr, _i64, _ptr, _i64, *[_ptr] * 7, _i64, _i64, _i64, _i64, _int]
    lib.baton_conv_update.restype = _i64
    lib.baton_conv_update.argtypes = [
        *(_ptr, _int, _i64, _ptr, _i64),
        *[_ptr] * 4,
        *(_i64, _i64, _int, _int),
    ]
    lib.baton_mamba_decode.restype = _i64
    lib.baton_mamba_decode.argtypes = [
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _i64,
        _ptr,
        _i64,  # rows, stride, pools, num_slots, slots, batch
        *[_ptr] * 5,  # conv_w, conv_b, dt_bias, A, D
        ctypes.c_float,
        ctypes.c_float,
        _ptr,
        ctypes.c_float,  # dt_min, dt_max, norm_w, eps
        _ptr,
        _ptr,
        _ptr,
        _int,  # xbc, y, out, bf16
        *[_i64] * 8,  # I, H, P, N, G, K, norm_group, norm_mode
        _int,
    ]
    lib.baton_decode_attention.restype = _i64
    lib.baton_decode_attention.argtypes = [
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        ctypes.c_float,
        _int,
        _int,
    ]
    lib.baton_extend_attention.restype = _i64
    lib.baton_extend_attention.argtypes = [
        *[_ptr] * 3,  # q, k_cache, v_cache
        _i64,  # num_token_slots
        _ptr,  # kv_indices
        _i64,  # its row stride
        _ptr,  # kv_lens
        _ptr,  # query_start_loc
        _ptr,  # out
        *[_i64] * 5,  # T, S, H, KVH, Dh
        ctypes.c_float,
        _int,
        _int,
    ]
    lib.baton_silu_mul.restype = None
    lib.baton_silu_mul.argtypes = [_ptr, _i64, _ptr, _i64, _i64, ctypes.c_float, _int, _int]
    lib.baton_rms_norm.restype = None
    lib.baton_rms_norm.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, ctypes.c_float, _int, _int]
    lib.baton_argmax_f32.restype = None
    lib.baton_argmax_f32.argtypes = [_ptr, _i64, _i64, _i64, _ptr, _int]
    return lib


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
        ssm_states.data_ptr(),
        ssm_states.shape[0],
        slots.data_ptr(),
        batch,
        xf.data_ptr(),
        dtf.data_ptr(),
        Af.data_ptr(),
        Bf.data_ptr(),
        Cf.data_ptr(),
        Df.data_ptr(),
        y.data_ptr(),
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
        conv_states.data_ptr(),
        int(conv_states.dtype == torch.bfloat16),
        conv_states.shape[0],
        slots.data_ptr(),
        batch,
        xf.data_ptr(),
        wf.data_ptr(),
        bf.data_ptr(),
        out.data_ptr(),
        dim,
        K,
        int(activation == "silu"),
        torch.get_num_threads(),
    )
    _check(result, slots, conv_states.shape[0], "causal_conv1d_update")
    return out.to(x.dtype)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(dim=-1)` for a (rows, vocab) float32 CPU tensor, rows spread over threads
    (torch's kernel runs ~1 ms on one core for 64 x 32000). Rows holding NaN go to torch, which
    ranks NaN highest."""
    lib = library()
    if (
        lib is None
        or logits.device.type != "cpu"
        or logits.dtype != torch.float32
        or logits.dim() != 2
        or logits.shape[1] == 0
        or logits.stride(1) != 1
    ):
        return logits.argmax(dim=-1)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64)
    lib.baton_argmax_f32(
        logits.data_ptr(), rows, cols, logits.stride(0), out.data_ptr(), torch.get_num_threads()
    )
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
        zxbcdt.data_ptr(),
        zxbcdt.stride(0),
        conv_states.data_ptr(),
        ssm_states.data_ptr(),
        ssm_states.shape[0],
        slots.data_ptr(),
        batch,
        params.conv_weight.data_ptr(),
        params.conv_bias.data_ptr(),
        params.dt_bias.data_ptr(),
        params.A.data_ptr(),
        params.D.data_ptr(),
        dt_limit[0],
        min(dt_limit[1], 3.0e38),
        params.norm_weight.data_ptr(),
        eps,
        xbc.data_ptr(),
        y.data_ptr(),
        out.data_ptr(),
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
        gate_up.data_ptr(),
        gate_up.stride(0),
        out.data_ptr(),
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
        x.data_ptr(),
        x.stride(0),
        weight_f32.data_ptr(),
        out.data_ptr(),
        rows,
        hidden,
        eps,
        int(x.dtype == torch.bfloat16),
        torch.get_num_threads(),
    )
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
) -> torch.Tensor:
    """Causal attention of packed queries over the paged cache (their own K/V stored already):
    sequence s's queries are rows query_start_loc[s]..[s + 1] of q (T, H, Dh), its last tokens
    of kv_lens[s]. Returns (T, H, Dh) in q's dtype; float32 arithmetic, like decode's."""
    return _attention_rows(q, k_cache, v_cache, kv_indices, kv_lens, query_start_loc, scale)


def _attention_rows(q, k_cache, v_cache, kv_indices, kv_lens, query_start_loc, scale):
    T, H, Dh = q.shape
    S = kv_lens.shape[0]
    q = q.contiguous()
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    kv_lens = kv_lens.to(torch.int32).contiguous()
    if kv_indices.stride(-1) != 1:
        kv_indices = kv_indices.contiguous()
    out = torch.empty(T, H, Dh, dtype=q.dtype)
    common = (
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.shape[0],
        kv_indices.data_ptr(),
        kv_indices.stride(0),
        kv_lens.data_ptr(),
    )
    tail = (H, k_cache.shape[1], Dh, scale, int(q.dtype == torch.bfloat16), torch.get_num_threads())
    if query_start_loc is None:
        result = library().baton_decode_attention(*common, out.data_ptr(), S, *tail)
    else:
        cu = query_start_loc.to(torch.int32).contiguous()
        result = library().baton_extend_attention(
            *common, cu.data_ptr(), out.data_ptr(), T, S, *tail
        )
    if result == -1:
        raise MemoryError("attention: no memory for the per-thread score buffers")
    if result == -2:
        raise ValueError("attention: query offsets or lengths do not fit the sequences' kv_lens")
    if result:
        raise IndexError(f"attention: sequence {result - 1} has a token slot outside the cache")
    return out
