"""The routed experts of a MoE layer in one C call (kernels/cpu_moe.c), for the CPU.

The router's choices go in, the weighted sum of each token's experts comes out: the grouping by
expert, the experts and the combine run in C, with each expert's weights packed once into
transposed panels the loop streams contiguously (decode reads each touched expert's weights once
per step, near the machine's memory bandwidth; prefill runs register-blocked FMAs on rows read
in place). Built and cached like kernels/cpu_ops.py; `BATON_CPU_OPS=0`, no compiler, a failed
build or weights this path does not take (not float32/bfloat16, not on the CPU) leave the
oneDNN per-expert path of kernels/moe.py, which agrees to float32 rounding
(tests/test_cpu_moe.py).

Shapes (T tokens, D the experts' model width, I expert width, E experts, k choices per token):
  x:        (T, D)  float32 or bfloat16 (it goes in at the weights' dtype), rows may be strided
  w_up:     (E, I, D) relu2 / (E, 2I, D) swiglu, gate rows first;  w_down: (E, D, I)
  routing:  ids (T, k) int64, weights (T, k) float32
  returns   (T, D) in x's dtype
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels import cpu_ops

SOURCE = Path(__file__).with_name("cpu_moe.c")
NB = 64  # panel width; must match cpu_moe.c
MAX_TOP_K = 64  # the C combine sorts each token's choices in a fixed-size array

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (no compiler, build failed, or BATON_CPU_OPS=0)."""
    lib = cpu_ops.compile_library(SOURCE, "CPU MoE runs the (slower) per-expert oneDNN path")
    if lib is None:
        return None
    lib.baton_moe_routed.restype = _i64
    lib.baton_moe_routed.argtypes = [
        _ptr,
        _i64,
        _i64,
        _i64,  # x, x_stride, T, D
        _ptr,
        _ptr,
        _i64,
        _i64,  # ids, weights, k, E
        _ptr,
        _ptr,
        _int,
        _i64,
        _int,  # up, down, bf16, I_pad, swiglu
        _ptr,
        _ptr,
        _ptr,  # scratch, h, ys
        _ptr,
        _int,  # out, threads
    ]
    return lib


class PanelExperts(NamedTuple):
    """Expert weights packed for cpu_moe.c (see its header for the layouts); pair = 2 for
    bfloat16 (k in pairs), 1 for float32."""

    up: torch.Tensor  # (E, parts, I_pad / NB, D_k / pair, NB, pair)
    down: torch.Tensor  # (E, ceil(D / NB), I_pad / pair, NB, pair)
    swiglu: bool


def _panels(w: torch.Tensor) -> torch.Tensor:
    """(E, rows, K) -> (E, rows_pad / NB, K_pad / pair, NB, pair): NB output rows at a time,
    transposed, k in pairs for bfloat16, zero past `rows` and K."""
    pair = 2 if w.dtype == torch.bfloat16 else 1
    E, rows, K = w.shape
    w = F.pad(w, (0, -K % pair, 0, -rows % NB))
    E, rows, K = w.shape
    return w.view(E, rows // NB, NB, K // pair, pair).permute(0, 1, 3, 2, 4).contiguous()


def pack_panels(w_up: torch.Tensor, w_down: torch.Tensor, swiglu: bool) -> PanelExperts | None:
    """None where the C path cannot take these weights (dtype, device, no library)."""
    if (
        w_up.device.type != "cpu"
        or w_up.dtype not in (torch.float32, torch.bfloat16)
        or w_down.dtype != w_up.dtype
        or library() is None
    ):
        return None
    E, _, D = w_up.shape
    inter = w_down.shape[2]
    parts = w_up.view(E, 2, inter, D).unbind(1) if swiglu else (w_up,)
    up = torch.stack([_panels(part) for part in parts], dim=1)
    down = _panels(F.pad(w_down, (0, -inter % NB)))  # zero columns for h's padding
    return PanelExperts(up=up, down=down, swiglu=swiglu)


def supported(x: torch.Tensor, top_k: int) -> bool:
    return x.device.type == "cpu" and 0 < top_k <= MAX_TOP_K and library() is not None


def routed_experts(
    x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, panels: PanelExperts
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), summed in float32: (T, D) in x's dtype."""
    lib = library()
    assert lib is not None
    T, D = x.shape
    k = ids.shape[1]
    dtype = panels.up.dtype  # the rows go in at the weights' dtype (a model's is both)
    E, I_pad = panels.up.shape[0], panels.down.shape[2] * panels.down.shape[4]
    rows = x.to(dtype)
    if dtype == torch.bfloat16 and D % 2:
        rows = F.pad(rows, (0, 1))  # the bf16 loop reads k in pairs
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    P = T * k
    scratch = torch.empty(E + 1 + 2 * P + E, dtype=torch.int64)
    h = torch.empty(P, I_pad, dtype=dtype)
    ys = torch.empty(P, D, dtype=torch.float32)
    out = torch.empty(T, D, dtype=dtype)
    bad = lib.baton_moe_routed(
        rows.data_ptr(),
        rows.stride(0),
        T,
        D,
        ids.data_ptr(),
        weights.data_ptr(),
        k,
        E,
        panels.up.data_ptr(),
        panels.down.data_ptr(),
        int(dtype == torch.bfloat16),
        I_pad,
        int(panels.swiglu),
        scratch.data_ptr(),
        h.data_ptr(),
        ys.data_ptr(),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if bad:
        raise IndexError(f"routed_experts: token {bad - 1} chose an expert outside [0, {E})")
    return out.to(x.dtype)
