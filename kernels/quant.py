"""Quantized weights as checkpoints ship them (FP8 e4m3, NVFP4 e2m1), the one definition of their
value, and the linear over them, dispatched like every kernel: the CPU's weight-only C kernel
(kernels/cpu/quant.py) on weights packed once, Triton on CUDA (kernels/triton/quant.py), and the
torch path (dequantize, then F.linear) elsewhere.

Whatever the checkpoint's scale layout (one scale per tensor, per output row, per 128 x 128 block,
per 16 inputs), a `QuantizedTensor` holds it per output row:

    fp8:   data  (..., N, K) float8_e4m3fn
           scale (..., N, ceil(K / group)) float32     value = data * scale[n, k // group]
    nvfp4: data  (..., N, K / 2) uint8                 input 2j in the low nibble, 2j+1 high
           scale (..., N, K / 16) float8_e4m3fn        value = e2m1(nibble) * scale[n, k // 16]
           global_scale (..., N) float32                                     * global_scale[n]

so rows from different checkpoint tensors (q | k | v fused, each with its own per-tensor scale)
concatenate exactly, and a tensor-parallel rank's rows are a slice. The leading dims are the
experts of a stacked MoE weight.
"""

from __future__ import annotations

import os
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend

QuantFormat = Literal["fp8", "nvfp4"]
FP8_MAX = 448.0  # largest finite e4m3fn
NVFP4_GROUP = 16  # inputs per e4m3 scale
NVFP4_MAX = 6.0  # largest e2m1
# e2m1 by nibble: bits 0-2 the magnitude, bit 3 the sign (ModelOpt's and vLLM's table)
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
ACTIVATIONS_ENV = "BATON_FP8_ACTIVATIONS"  # "dynamic" (w8a8 on the GPU) or "none" (weight-only)


class QuantizedTensor(NamedTuple):
    """A quantized (..., N, K) weight with per-row scales (module docstring)."""

    format: QuantFormat
    data: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None  # nvfp4 only
    group: int  # inputs per scale column

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical (..., N, K) shape of the weight."""
        *lead, n, width = self.data.shape
        return (*lead, n, width * 2 if self.format == "nvfp4" else width)

    @property
    def device(self) -> torch.device:
        return self.data.device

    def nbytes(self) -> int:
        """Bytes a forward reads: codes and scales (a model's decode step streams them)."""
        tensors = [self.data, self.scale] + ([self.global_scale] if self.format == "nvfp4" else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def rows(self, index) -> QuantizedTensor:
        """The weight of `index` into the leading dims (one expert of a stack)."""
        return QuantizedTensor(
            self.format,
            self.data[index],
            self.scale[index],
            None if self.global_scale is None else self.global_scale[index],
            self.group,
        )


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """One weight whose rows are the parts' rows in order (each keeps its own scales)."""
    first = parts[0]
    if any(p.format != first.format or p.group != first.group for p in parts):
        raise ValueError("quantized parts differ in format or scale group and cannot be fused")
    return QuantizedTensor(
        first.format,
        torch.cat([p.data for p in parts], dim=-2),
        torch.cat([p.scale for p in parts], dim=-2),
        None if first.global_scale is None else torch.cat([p.global_scale for p in parts], -1),
        first.group,
    )


def fp4_unpack(data: torch.Tensor) -> torch.Tensor:
    """(..., K / 2) uint8 -> (..., K) float32 e2m1 values (low nibble first)."""
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=data.device)
    pairs = torch.stack([table[(data & 0xF).long()], table[(data >> 4).long()]], dim=-1)
    return pairs.flatten(-2)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight's value (..., N, K), computed in float32 as the formats define it."""
    k = q.shape[-1]
    if q.format == "fp8":
        scale = q.scale.float().repeat_interleave(q.group, dim=-1)[..., :k]
        return (q.data.float() * scale).to(dtype)
    scale = q.scale.float().repeat_interleave(NVFP4_GROUP, dim=-1)
    return (fp4_unpack(q.data) * scale * q.global_scale.float()[..., None]).to(dtype)


def quantize_fp8(weight: torch.Tensor) -> QuantizedTensor:
    """Online FP8 (vLLM's `--quantization fp8` on an unquantized checkpoint): one scale per
    (..., N, K) matrix, amax / 448, codes rounded to nearest even."""
    amax = weight.detach().float().abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (weight.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    rows = scale.expand(*weight.shape[:-1], 1).contiguous()
    return QuantizedTensor("fp8", codes, rows, None, weight.shape[-1])


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token FP8 (the GPU's w8a8 activations): (T, K) -> codes (T, K) e4m3 and the
    scale of each row (T, 1) float32, amax / 448 (a zero row gets scale 1)."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_activations(device: torch.device) -> Literal["dynamic", "none"]:
    """Whether FP8 linears also quantize their inputs (w8a8, dynamic per-token scales) on this
    device: on GPUs with FP8 tensor cores (compute capability 8.9+) by default; never on the CPU
    (weight-only). `BATON_FP8_ACTIVATIONS=dynamic|none` forces either on a GPU."""
    if device.type != "cuda":
        return "none"
    forced = os.environ.get(ACTIVATIONS_ENV, "").strip().lower()
    if forced in ("dynamic", "none"):
        return forced  # type: ignore[return-value]
    if forced:
        raise ValueError(f"{ACTIVATIONS_ENV} must be 'dynamic' or 'none', got {forced!r}")
    return "dynamic" if torch.cuda.get_device_capability(device) >= (8, 9) else "none"


def quant_linear(
    x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T (+ bias) for a 2-D quantized W, in x's dtype: Triton on CUDA (w8a8 or
    weight-only, see fp8_activations), the torch path otherwise. (The CPU engine packs its
    weights once and calls kernels/cpu/quant.py instead.)"""
    if select_backend(x) == "triton":
        from baton.kernels.triton.quant import quant_linear_triton

        return quant_linear_triton(x, q, bias, fp8_activations(x.device))
    return quant_linear_torch(x, q, bias)


def quant_linear_torch(
    x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The reference: dequantize (transiently) and multiply in x's dtype."""
    return F.linear(x, dequantize(q, x.dtype), None if bias is None else bias.to(x.dtype))


def w8a8_linear_torch(
    x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the GPU's w8a8 kernel computes, in torch: each row of x quantized to e4m3 with its
    own scale, products of codes summed in float32, then times the row's and the weight's
    scales (per k-group), plus bias, in x's dtype."""
    codes, row_scale = quantize_rows_fp8(x)
    k = q.shape[-1]
    out = torch.zeros(x.shape[0], q.shape[-2], dtype=torch.float32, device=x.device)
    for start in range(0, k, q.group):
        stop = min(k, start + q.group)
        part = codes[:, start:stop].float() @ q.data[:, start:stop].float().T
        out += part * q.scale[:, start // q.group].float()
    out = out * row_scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
