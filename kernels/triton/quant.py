"""Quantized linears in Triton (the GPU path of kernels/quant.py):

    w8a8         FP8 weights x FP8 activations: each row of x quantized to e4m3 with its own
                 dynamic scale (amax / 448, `_quantize_rows_kernel`), e4m3 products summed in
                 float32 on the tensor cores, then times the weight's per-row scale of each
                 k-group and the row's scale (Hopper and Ada: compute capability 8.9+)
    weight-only  FP8 or NVFP4 weights decoded to float32 in the tile that is multiplied (x stays
                 in the model dtype): any GPU, and every weight whose scale groups w8a8's tiles
                 cannot follow (a group not a multiple of 32)

`load_weight_tile` is the one decoder, shared with the fused MoE kernels (kernels/triton/moe.py).
Shapes as kernels/quant.py: x (M, K); weights (N, K) e4m3 or (N, K / 2) uint8 with scales per
row (N, groups) float32 / (N, K / 16) e4m3 and NVFP4's (N,) float32 global scale. No autotune
(one config; the interpreter refuses several).

In the Triton interpreter (CPU tests) e4m3 loads, bitcasts and e4m3 tl.dot are exact, but the
float32 -> e4m3 cast is not (a value whose rounding carries into the exponent comes out halved:
31.3 -> 16; ties do not go to even): `_quantize_rows_kernel`'s codes are checked on a GPU only
(tests/gpu/test_quant_gpu.py), its scales everywhere, and the w8a8 GEMM in the interpreter on
codes quantized by torch.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl
from baton.kernels.backend import dot_precision
from baton.kernels.quant import FP8_MAX, QuantizedTensor

FORMAT_PLAIN, FORMAT_FP8, FORMAT_NVFP4 = 0, 1, 2
FORMATS = {"fp8": FORMAT_FP8, "nvfp4": FORMAT_NVFP4}


@triton.jit
def load_weight_tile(
    w_ptr,  # this matrix's codes (plain weights: its values)
    scale_ptr,  # fp8: float32 (N, SCALE_COLS); nvfp4: e4m3 (N, K / 16)
    global_ptr,  # nvfp4: float32 (N,)
    offs_n,  # (BLOCK_N,) rows of W
    offs_k,  # (BLOCK_K,) inputs
    mask_n,
    mask_k,
    K,
    SCALE_COLS,
    GROUP,
    FORMAT: tl.constexpr,
):
    """W[offs_n, offs_k] as a (BLOCK_K, BLOCK_N) tile (transposed, ready for x @ tile): the
    stored values for plain weights, float32 values for quantized ones."""
    mask = mask_n[None, :] & mask_k[:, None]
    if FORMAT == 0:
        tile = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=mask, other=0.0)
    elif FORMAT == 1:
        codes = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=mask, other=0.0)
        scale = tl.load(
            scale_ptr + offs_n[None, :] * SCALE_COLS + offs_k[:, None] // GROUP,
            mask=mask,
            other=0.0,
        )
        tile = codes.to(tl.float32) * scale
    else:
        byte = tl.load(
            w_ptr + offs_n[None, :] * (K // 2) + offs_k[:, None] // 2, mask=mask, other=0
        )
        nibble = (byte >> ((offs_k[:, None] % 2) * 4).to(tl.uint8)) & 0xF
        magnitude = nibble & 7
        exponent = (magnitude >> 1).to(tl.int32)
        mantissa = (magnitude & 1).to(tl.float32)
        # e2m1: exponent 0 is 0 or 0.5, else (1 + m / 2) * 2^(e - 1)
        power = tl.where(exponent == 3, 4.0, tl.where(exponent == 2, 2.0, 1.0))
        value = tl.where(exponent == 0, 0.5 * mantissa, (1.0 + 0.5 * mantissa) * power)
        value = tl.where((nibble & 8) != 0, -value, value)
        scale = tl.load(
            scale_ptr + offs_n[None, :] * (K // 16) + offs_k[:, None] // 16, mask=mask, other=0.0
        ).to(tl.float32)
        global_scale = tl.load(global_ptr + offs_n, mask=mask_n, other=0.0)
        tile = value * scale * global_scale[None, :]
    return tile


@triton.jit
def _weight_only_kernel(
    x_ptr,  # (M, K) model dtype
    w_ptr,
    scale_ptr,
    global_ptr,
    bias_ptr,  # (N,) float32, or x_ptr when HAS_BIAS is False
    out_ptr,  # (M, N) model dtype
    M,
    N,
    K,
    SCALE_COLS,
    GROUP,
    FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            x_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = load_weight_tile(
            w_ptr,
            scale_ptr,
            global_ptr,
            offs_n,
            offs_k,
            mask_n,
            mask_k,
            K,
            SCALE_COLS,
            GROUP,
            FORMAT,
        )
        acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _w8a8_kernel(
    a_ptr,  # (M, K) e4m3 codes of x
    a_scale_ptr,  # (M,) float32
    w_ptr,  # (N, K) e4m3
    scale_ptr,  # (N, SCALE_COLS) float32
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    SCALE_COLS,
    GROUP,  # a multiple of BLOCK_K, or >= K: each tile lies in one group
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
            mask=mask_n[None, :] & mask_k[:, None],
            other=0.0,
        )
        scale = tl.load(scale_ptr + offs_n * SCALE_COLS + k0 // GROUP, mask=mask_n, other=0.0)
        acc += tl.dot(a, w) * scale[None, :]
    acc *= tl.load(a_scale_ptr + offs_m, mask=mask_m, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    tl.store(
        out_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_n[None, :],
    )


@triton.jit
def _quantize_rows_kernel(
    x_ptr, codes_ptr, scale_ptr, K, FP8_LIMIT: tl.constexpr, BLOCK_K: tl.constexpr
):
    """One row per program: amax, then codes = e4m3(x / (amax / 448))."""
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, top / FP8_LIMIT, 1.0)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * K + offs, mask=offs < K, other=0.0).to(tl.float32)
        codes = tl.minimum(tl.maximum(x / scale, -FP8_LIMIT), FP8_LIMIT)
        tl.store(codes_ptr + row * K + offs, codes.to(tl.float8e4nv), mask=offs < K)


def quantize_rows_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) -> (M, K) e4m3 codes and (M, 1) float32 scales (baton.kernels.quant.quantize_rows_fp8)."""
    x = x.contiguous()
    M, K = x.shape
    codes = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        block = min(1024, triton.next_power_of_2(K))
        _quantize_rows_kernel[(M,)](x, codes, scale, K, FP8_LIMIT=FP8_MAX, BLOCK_K=block)
    return codes, scale


def w8a8_block_k(q: QuantizedTensor) -> int | None:
    """The k-tile w8a8 runs `q` with (each tile within one scale group), None when its groups
    are too fine for an e4m3 tl.dot (32 inputs at least)."""
    k = q.shape[-1]
    for block in (64, 32):
        if q.group >= k or q.group % block == 0:
            return block
    return None


def _blocks(m: int) -> tuple[int, int]:
    return (16 if m <= 16 else 64), 64


def w8a8_matmul(
    codes: torch.Tensor,
    row_scale: torch.Tensor,
    q: QuantizedTensor,
    bias: torch.Tensor | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """(codes * row_scale) @ W.T (+ bias), codes (M, K) e4m3 with row_scale (M, 1) float32."""
    M, K = codes.shape
    N = q.shape[0]
    block_k = w8a8_block_k(q)
    assert block_k is not None, "w8a8 needs scale groups of 32 inputs or more"
    out = torch.empty(M, N, dtype=out_dtype, device=codes.device)
    if M == 0:
        return out
    block_m, block_n = _blocks(M)
    _w8a8_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        codes.contiguous(),
        row_scale.contiguous(),
        q.data.contiguous(),
        q.scale.float().contiguous(),
        codes if bias is None else bias.float().contiguous(),
        out,
        M,
        N,
        K,
        q.scale.shape[-1],
        q.group,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out


def weight_only_matmul(
    x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ dequantize(W).T (+ bias) in x's dtype, W decoded tile by tile."""
    x = x.contiguous()
    M, K = x.shape
    N = q.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    block_m, block_n = _blocks(M)
    scale = q.scale.contiguous() if q.format == "nvfp4" else q.scale.float().contiguous()
    _weight_only_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        x,
        q.data.contiguous(),
        scale,
        q.global_scale.contiguous() if q.global_scale is not None else scale,
        x if bias is None else bias.float().contiguous(),
        out,
        M,
        N,
        K,
        q.scale.shape[-1],
        q.group,
        FORMAT=FORMATS[q.format],
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=32,
        PRECISION=dot_precision(x.dtype),
    )
    return out


def quant_linear_triton(
    x: torch.Tensor, q: QuantizedTensor, bias: torch.Tensor | None, activations: str
) -> torch.Tensor:
    """x (..., K) @ W.T (+ bias) in x's dtype; activations "dynamic" runs FP8 weights as w8a8
    (where their scale groups allow), "none" weight-only."""
    rows = x.reshape(-1, x.shape[-1])
    if q.format == "fp8" and activations == "dynamic" and w8a8_block_k(q) is not None:
        codes, row_scale = quantize_rows_fp8_triton(rows)
        out = w8a8_matmul(codes, row_scale, q, bias, x.dtype)
    else:
        out = weight_only_matmul(rows, q, bias)
    return out.view(*x.shape[:-1], q.shape[0])
