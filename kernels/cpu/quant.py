"""The CPU's weight-only quantized linear (kernels/cpu/quant.c): FP8 and NVFP4 weights packed once
into 16-column panels of their own codes and scales, decoded in registers on every call (the
decode step streams half (FP8) or about a quarter (NVFP4) of a bf16 weight's bytes).

Weight-only: the inputs stay in the model's dtype (widened to float32), products and sums are
float32, so a layer computes x @ dequantize(W).T to float32 rounding (tests/test_quant_formats.py)
whatever the checkpoint's `input_scale` says (it is not applied: W8A16 / W4A16 numerics). Built
and cached like kernels/cpu/ops.py; without AVX-512 or AVX2 + FMA, without a compiler, or with
`BATON_CPU_OPS=0`, the torch path of kernels/quant.py runs instead.

Shapes: x (..., K) float32 or bfloat16; packed from `pack(QuantizedTensor (N, K))`; bias (N,)
float32 or None; returns (..., N) in x's dtype.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.cpu.extension import Kernels
from baton.kernels.cpu.extension import library as cpu_library
from baton.kernels.quant import NVFP4_GROUP, QuantFormat, QuantizedTensor

SOURCE = Path(__file__).with_name("quant.c")
BLOCK = 16  # output columns per panel; must match cpu/quant.c
FORMAT_CODES = {"fp8": 0, "nvfp4": 1}
# The decode reads e4m3 codes as float32 bits worth value * 2^-120 (cpu/quant.h); the packed
# scales carry the 2^120 back, less `shift` when a scale that large would overflow float32.
DECODE_EXPONENT = 120
MAX_PACKED_EXPONENT = 126
SERIAL_WORK = 1 << 18
AMX_MIN_ROWS = 8  # cpu/quant.c's amx_min_rows at load: bf16 rows from here run on AMX tiles


@functools.cache
def library() -> Kernels | None:
    """The C kernels as torch operators (kernels/cpu/extension.py), or None: quantized CPU linears run the torch path."""
    return cpu_library()


def supported() -> bool:
    lib = library()
    return lib is not None and bool(lib.baton_qgemm_supported())


def amx_from_rows(rows: int) -> bool:
    """A bf16 model's calls of `rows` rows and more run on AMX tiles, the weights decoded into
    bf16 tiles once per block and row panel (rows < 1: none do; the default is AMX_MIN_ROWS);
    returns whether this build and process run AMX at all."""
    lib = library()
    return lib is not None and bool(lib.baton_qgemm_amx(rows))


def fp4_dot(on: bool | None = None) -> bool:
    """Whether NVFP4 on a bf16 model's rows below AMX's rows runs the VDPBF16PS kernels (on the
    rows as they are) instead of the float32 ones (widened rows): set it with `on` where this
    build has them (AVX512-BF16); the default is on only where the CPU has no AMX (cpu/quant.c's
    baton_qgemm_fp4_dot says why). Returns the choice in force."""
    lib = library()
    return lib is not None and bool(lib.baton_qgemm_fp4_dot(-1 if on is None else int(on)))


class PackedQuant(NamedTuple):
    """A quantized (N, K) weight in cpu/quant.c's panels (its header gives the layouts)."""

    format: QuantFormat
    codes: torch.Tensor  # uint8 (N_pad / 16, steps, 16); AVX-512 nvfp4: (N_pad / 16, K / 8, 64)
    scales: torch.Tensor  # fp8: float32 (N_pad / 16, groups, 16); nvfp4: uint8 (N_pad/16, K/16, 16)
    col: torch.Tensor | None  # float32 (N_pad,): NVFP4's global scale, FP8's 2^shift
    group: int
    out_features: int
    in_features: int

    def nbytes(self) -> int:
        tensors = [self.codes, self.scales] + ([self.col] if self.col is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)


def scale_shift(largest: float) -> int:
    """The power of two FP8 scales give up to the output multiplier so that scale * 2^120 stays
    a finite float32 (0 for any real checkpoint: its scales are far below 2^6)."""
    if largest <= 0:
        return 0
    return max(0, math.ceil(math.log2(largest)) + DECODE_EXPONENT - MAX_PACKED_EXPONENT)


def _panels(rows: torch.Tensor) -> torch.Tensor:
    """(N, W) -> (N_pad / 16, W, 16): 16 rows at a time, transposed; zero rows past N."""
    padded = F.pad(rows, (0, 0, 0, -rows.shape[0] % BLOCK))
    return padded.view(-1, BLOCK, padded.shape[1]).transpose(1, 2).contiguous()


def _fp4_lanes(pairs: torch.Tensor) -> torch.Tensor:
    """NVFP4 panels of a byte per column and input pair (N_pad / 16, K / 2, 16) -> a 32-bit lane
    per column and 8 inputs (N_pad / 16, K / 8, 64): input 8e + 2t's nibble at nibble t of the
    lane, 8e + 2t + 1's at nibble 4 + t (cpu/quant.c's AVX-512 steps)."""
    blocks, half, _ = pairs.shape
    quads = pairs.view(blocks, half // 4, 4, BLOCK).transpose(2, 3)  # [..., column, t]
    low, high = quads & 0x0F, quads >> 4
    lane = torch.stack(
        [
            low[..., 0] | low[..., 1] << 4,
            low[..., 2] | low[..., 3] << 4,
            high[..., 0] | high[..., 1] << 4,
            high[..., 2] | high[..., 3] << 4,
        ],
        dim=-1,
    )  # little-endian bytes of the lane: nibbles 0..7
    return lane.reshape(blocks, half // 4, 4 * BLOCK)


def pack(q: QuantizedTensor) -> PackedQuant:
    """Repack a 2-D quantized weight for the kernel (codes and scales stay quantized)."""
    n, k = q.shape
    if q.format == "nvfp4" and k % NVFP4_GROUP:
        raise ValueError(f"NVFP4 weights need in_features divisible by 16, got {k}")
    codes = _panels(q.data.view(torch.uint8))
    lib = library()
    if q.format == "nvfp4" and lib is not None and lib.baton_qgemm_fp4_inputs_per_lane() == 8:
        codes = _fp4_lanes(codes)
    if q.format == "fp8":
        shift = scale_shift(float(q.scale.abs().max()) if q.scale.numel() else 0.0)
        scales = _panels(q.scale.float() * 2.0 ** (DECODE_EXPONENT - shift))
        col = torch.full((codes.shape[0] * BLOCK,), 2.0**shift) if shift else None
    else:
        scales = _panels(q.scale.view(torch.uint8))
        col = F.pad(q.global_scale.float(), (0, codes.shape[0] * BLOCK - n)).contiguous()
    return PackedQuant(q.format, codes, scales, col, q.group, n, k)


def threads(m: int, n: int, k: int) -> int:
    """Threads for an (m, k) x (k, n) call: one below SERIAL_WORK multiply-adds, where waking a
    second thread costs more than its half of the work (a tiny model's layers)."""
    return 1 if m * n * k < SERIAL_WORK else torch.get_num_threads()


def linear(
    x: torch.Tensor, packed: PackedQuant, bias: torch.Tensor | None = None, relu: bool = False
) -> torch.Tensor:
    """`x @ W.T (+ bias) (relu)` for `packed = pack(W)`, in x's dtype."""
    lib = library()
    k, n = packed.in_features, packed.out_features
    if lib is None or x.shape[-1] != k:
        raise ValueError(f"cpu_quant: x {tuple(x.shape)} does not fit a ({n}, {k}) weight")
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # a decode step's rows: no reshape
    if rows.dtype not in (torch.float32, torch.bfloat16) or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    m = rows.shape[0]
    # bfloat16 rows are widened and the result narrowed in C (baton_qgemm_bf16): two fewer
    # tensor ops per call, which a batch-1 decode step makes dozens of.
    entry = lib.baton_qgemm_bf16 if rows.dtype == torch.bfloat16 else lib.baton_qgemm
    y = torch.empty(m, n, dtype=rows.dtype)
    if m:
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
            raise ValueError("cpu_quant: the bias is a contiguous float32 vector")
        status = entry(
            FORMAT_CODES[packed.format],
            rows,
            m,
            k,
            rows.stride(0),
            packed.codes,
            packed.scales,
            packed.group,
            None if packed.col is None else packed.col,
            n,
            bias,
            int(relu),
            y,
            n,
            threads(m, n, k),
        )
        if status != 0:
            raise RuntimeError(f"cpu_quant: the kernel refused a {packed.format} weight ({status})")
    if x.dim() != 2:
        y = y.view(*x.shape[:-1], n)
    return y if y.dtype == x.dtype else y.to(x.dtype)
