"""The routed experts of a MoE layer in one C call (kernels/cpu/moe.c), for the CPU.

The router's choices go in, the weighted sum of each token's experts comes out: the grouping by
expert, the experts and the combine run in C, with each expert's weights packed once into
transposed panels the loop streams contiguously (decode reads each touched expert's weights once
per step, near the machine's memory bandwidth; prefill runs register-blocked FMAs on rows read
in place). Built and cached like kernels/cpu/ops.py; `BATON_CPU_OPS=0`, no compiler, a failed
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

import functools
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.cpu import quant as cpu_quant
from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library
from baton.kernels.lora import ExpertDeltas
from baton.kernels.quant import NVFP4_GROUP, QuantFormat, QuantizedTensor

SOURCE = Path(__file__).with_name("moe.c")
NB = 64  # panel width; must match cpu/moe.c
MAX_TOP_K = 64  # the C combine sorts each token's choices in a fixed-size array
FORMATS = {"f32": 0, "bf16": 1, "fp8": 2, "nvfp4": 3}  # cpu/moe.c's FMT_*


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: CPU MoE runs the (slower) per-expert oneDNN path."""
    return cpu_library()


class PanelExperts(NamedTuple):
    """Expert weights packed for cpu/moe.c (see its header for the layouts); pair = 2 for
    bfloat16 (k in pairs), 1 for float32."""

    up: torch.Tensor  # (E, parts, I_pad / NB, D_k / pair, NB, pair)
    down: torch.Tensor  # (E, ceil(D / NB), I_pad / pair, NB, pair)
    swiglu: bool


class QuantPanel(NamedTuple):
    """One projection's quantized experts in cpu/moe.c's panels (codes stay quantized)."""

    codes: torch.Tensor  # uint8 (E, parts, panels, steps, NB): steps K (FP8) or K / 2 (NVFP4)
    scales: torch.Tensor  # FP8: float32 (E, parts, panels, groups, NB); NVFP4: uint8 (.., K/16, NB)
    col: torch.Tensor | None  # float32 (E, parts, panels * NB): NVFP4's global scale, FP8's shift
    group: int  # FP8: inputs per scale group


class QuantPanelExperts(NamedTuple):
    """Quantized expert weights for cpu/moe.c: FP8 or NVFP4 (x, h and the sums in float32)."""

    format: QuantFormat
    up: QuantPanel
    down: QuantPanel
    inter_pad: int  # I_pad
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


def pack_quantized(
    w_up: QuantizedTensor, w_down: QuantizedTensor, swiglu: bool
) -> QuantPanelExperts | None:
    """Quantized experts in panels; None without the library or AVX-512 / AVX2 + FMA."""
    if w_up.device.type != "cpu" or library() is None or not cpu_quant.supported():
        return None
    if w_up.format != w_down.format:
        return None
    E, rows, _ = w_up.shape
    inter = w_down.shape[2]
    i_pad = -(-inter // NB) * NB
    parts = 2 if swiglu else 1
    up = _quant_panel(_split_parts(w_up, parts), i_pad, None)
    down = _quant_panel(_split_parts(w_down, 1), -(-w_down.shape[1] // NB) * NB, i_pad)
    return QuantPanelExperts(w_up.format, up, down, i_pad, swiglu)


def _split_parts(q: QuantizedTensor, parts: int) -> QuantizedTensor:
    """(E, parts * R, ...) -> (E, parts, R, ...) for each of the tensor's fields."""

    def split(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.view(t.shape[0], parts, t.shape[1] // parts, *t.shape[2:])

    return QuantizedTensor(q.format, split(q.data), split(q.scale), split(q.global_scale), q.group)


def _quant_panel(q: QuantizedTensor, rows_pad: int, k_pad: int | None) -> QuantPanel:
    """(E, parts, R, ...) quantized rows -> panels of NB rows, transposed; rows padded to
    rows_pad, inputs (when k_pad) to k_pad with zero codes and zero scales."""
    codes, scale = q.data.view(torch.uint8), q.scale
    if q.format == "fp8":
        largest = float(scale.abs().max()) if scale.numel() else 0.0
        shift = cpu_quant.scale_shift(largest)
        scale = scale.float() * 2.0 ** (cpu_quant.DECODE_EXPONENT - shift)
        col = None if not shift else torch.full((*codes.shape[:2], rows_pad), 2.0**shift)
    else:
        scale = scale.view(torch.uint8)
        col = F.pad(q.global_scale.float(), (0, rows_pad - q.global_scale.shape[-1]))
    if k_pad is not None:
        per_byte = 2 if q.format == "nvfp4" else 1
        codes = F.pad(codes, (0, k_pad // per_byte - codes.shape[-1]))
        groups = k_pad // NVFP4_GROUP if q.format == "nvfp4" else -(-k_pad // q.group)
        scale = F.pad(scale, (0, groups - scale.shape[-1]))

    def panels(t: torch.Tensor) -> torch.Tensor:
        t = F.pad(t, (0, 0, 0, rows_pad - t.shape[-2]))
        E, parts, rows, width = t.shape
        return t.view(E, parts, rows // NB, NB, width).transpose(-1, -2).contiguous()

    return QuantPanel(panels(codes), panels(scale), col, q.group)


def supported(x: torch.Tensor, top_k: int, lora: ExpertDeltas | None) -> bool:
    """lora: expert adapters, whose tables the C call reads in float32 or bfloat16."""
    return (
        x.device.type == "cpu"
        and 0 < top_k <= MAX_TOP_K
        and library() is not None
        and (lora is None or lora.down_a.dtype in (torch.float32, torch.bfloat16))
    )


def routed_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    panels: PanelExperts | QuantPanelExperts,
    lora: ExpertDeltas | None = None,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]), summed in float32: (T, D) in x's dtype;
    with each pair's adapter deltas (kernels/lora.py's ExpertDeltas) when `lora`."""
    lib = library()
    assert lib is not None
    T, D = x.shape
    k = ids.shape[1]
    quant = isinstance(panels, QuantPanelExperts)
    if quant:
        dtype, fmt = torch.float32, FORMATS[panels.format]
        E, I_pad = panels.up.codes.shape[0], panels.inter_pad
    else:
        dtype = panels.up.dtype  # the rows go in at the weights' dtype (a model's is both)
        fmt = FORMATS["bf16" if dtype == torch.bfloat16 else "f32"]
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
        rows,
        rows.stride(0),
        T,
        D,
        ids,
        weights,
        k,
        E,
        panels.up.codes if quant else panels.up,
        panels.down.codes if quant else panels.down,
        fmt,
        I_pad,
        int(panels.swiglu),
        scratch,
        h,
        ys,
        out,
        torch.get_num_threads(),
        *(_quant_args(panels) if quant else (None, None, None, None, 0, 0)),
        *(
            _lora_args(lora, x, ids)
            if lora is not None
            else (None, 0, None, None, None, 0, 0, 0, None)
        ),
    )
    if bad:
        raise IndexError(f"routed_experts: token {bad - 1} chose an expert outside [0, {E})")
    return out.to(x.dtype)


def _lora_args(lora: ExpertDeltas, x: torch.Tensor, ids: torch.Tensor) -> tuple:
    """cpu/moe.c's expert-adapter arguments: each pair's up delta, its row group, the down
    tables, their dtype, rank and width, the shrink's scratch."""
    pair_slots = lora.pair_slots(ids).contiguous()
    up_delta = lora.up_delta(x, pair_slots, ids.shape[1])
    inter = lora.down_a.shape[1]
    low = torch.empty(pair_slots.shape[0], lora.rank, dtype=torch.float32)
    bf16 = int(lora.down_a.dtype == torch.bfloat16)
    return (up_delta, up_delta.shape[1], pair_slots, lora.down_a, lora.down_b, bf16, lora.rank,
            inter, low)  # fmt: skip


def _quant_args(panels: QuantPanelExperts) -> tuple:
    up, down = panels.up, panels.down
    return (
        up.scales,
        down.scales,
        up.col,
        down.col,
        up.group,
        down.group,
    )
