"""RMSNorm and gated RMSNorm, Triton path (semantics: kernels/norm.py).

    rms_norm:        out = (weight * x * rsqrt(mean(x^2) + eps)).to(x.dtype)      (weight in fp32)
    gated_rms_norm:  h = y * silu(z) per group of `group_size`;
                     out = weight * (h * rsqrt(mean_group(h^2) + eps)).to(y.dtype)

One program normalises ROWS rows of one group, each held whole in registers (BLOCK = next power
of two of the group; ROWS > 1 only for small groups). Like the torch path, the gated norm rounds the normalised value to y's dtype before
the weight multiply, and returns the promoted dtype of (weight, y).
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl


# fmt: off
@triton.jit
def _rms_norm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr,
    stride_x_t, stride_x_d, stride_z_t, stride_z_d, stride_o_t, stride_o_d,
    num_tokens, group_size, eps,
    GATED: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr,
):
    # fmt: on
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    d = tl.program_id(1) * group_size + col
    mask = (t < num_tokens)[:, None] & (col < group_size)[None, :]
    x_raw = tl.load(x_ptr + t[:, None] * stride_x_t + d[None, :] * stride_x_d, mask=mask, other=0.0)
    h = x_raw.to(tl.float32)
    if GATED:
        z = tl.load(
            z_ptr + t[:, None] * stride_z_t + d[None, :] * stride_z_d, mask=mask, other=0.0
        ).to(tl.float32)
        h = h * (z / (1.0 + tl.exp(-z)))
    h = h * tl.rsqrt(tl.sum(h * h, axis=1) / group_size + eps)[:, None]
    w = tl.load(w_ptr + d, mask=col < group_size, other=0.0).to(tl.float32)
    if GATED:
        h = h.to(x_raw.dtype).to(tl.float32)  # round like the torch path, then weight
    tl.store(
        out_ptr + t[:, None] * stride_o_t + d[None, :] * stride_o_d,
        (w[None, :] * h).to(out_ptr.dtype.element_ty), mask=mask,
    )


def _launch(x, z, weight, out, eps: float, group_size: int) -> None:
    num_tokens, width = x.shape
    if num_tokens == 0:
        return
    BLOCK = triton.next_power_of_2(group_size)
    ROWS = max(1, min(64, 4096 // BLOCK))  # small groups: several rows per program
    gated = z is not None
    zz = z if gated else x
    # fmt: off
    _rms_norm_kernel[(triton.cdiv(num_tokens, ROWS), width // group_size)](
        x, zz, weight, out,
        x.stride(0), x.stride(1), zz.stride(0), zz.stride(1), out.stride(0), out.stride(1),
        num_tokens, group_size, float(eps),
        GATED=gated, ROWS=ROWS, BLOCK=BLOCK, num_warps=min(16, max(1, ROWS * BLOCK // 256)),
    )
    # fmt: on


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (num_tokens, hidden) float32/float16/bfloat16, any strides; weight: (hidden,).
    Returns (num_tokens, hidden) in x's dtype."""
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"rms_norm: x must be (num_tokens, hidden) and weight (hidden,), got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    _launch(x, None, weight, out, eps, x.shape[1])
    return out


def gated_rms_norm_triton(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """y, z: (num_tokens, intermediate) float32/float16/bfloat16, any strides; weight:
    (intermediate,); intermediate divisible by group_size. Returns (num_tokens, intermediate)
    in the promoted dtype of (weight, y), like the torch path."""
    if y.dim() != 2 or z.shape != y.shape or weight.shape != (y.shape[1],):
        raise ValueError(f"gated_rms_norm: y and z must be (num_tokens, intermediate) and weight "
                         f"(intermediate,), got {tuple(y.shape)}, {tuple(z.shape)}, "
                         f"{tuple(weight.shape)}")
    if y.shape[1] % group_size:
        raise ValueError(f"intermediate {y.shape[1]} is not a multiple of group_size {group_size}")
    out_dtype = torch.promote_types(weight.dtype, y.dtype)
    out = torch.empty(y.shape, device=y.device, dtype=out_dtype)
    _launch(y, z, weight, out, eps, group_size)
    return out
