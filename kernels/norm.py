"""RMSNorm and gated RMSNorm (`norm(y * silu(z))`, normalised per group), torch path.

Both compute in float32 and cast back like transformers' NemotronH: RMSNorm multiplies the
weight in float32, the gated norm multiplies it after the cast to the input dtype. The public
functions dispatch with select_backend like every kernel (Triton path: kernels/triton/norm.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.kernels.backend import select_backend
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.cpu import prefill as cpu_prefill


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: (num_tokens, hidden) any float dtype; weight: (hidden,). Returns x's dtype."""
    if select_backend(x) == "triton":
        from baton.kernels.triton.norm import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    if cpu_ops.rms_norm_supported(x):
        return cpu_ops.rms_norm_cpu(x, weight.float().contiguous(), eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf).to(x.dtype)


def gated_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """y, z: (num_tokens, intermediate); weight: (intermediate,); groups of `group_size`.

    Returns `weight * rmsnorm_per_group(y * silu(z))` in y's dtype.
    """
    if select_backend(y) == "triton":
        from baton.kernels.triton.norm import gated_rms_norm_triton

        return gated_rms_norm_triton(y, z, weight, eps, group_size)
    if cpu_prefill.gated_norm_supported(y, z, weight):
        return cpu_prefill.gated_rms_norm_cpu(y, z, weight, eps, group_size)
    return gated_rms_norm_torch(y, z, weight, eps, group_size)


def gated_rms_norm_torch(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    num_tokens, width = y.shape
    h = y.float() * F.silu(z.float())
    h = h.view(num_tokens, width // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(num_tokens, width).to(y.dtype)


def group_rms_norm(
    y: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int
) -> torch.Tensor:
    """y: (num_tokens, width); weight: (width,). Returns float32 `weight * rmsnorm_per_group(y)`
    with the weight applied in float32 (Falcon-H1's norm before its gate; the caller gates and
    casts)."""
    num_tokens, width = y.shape
    h = y.float().view(num_tokens, width // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight.float() * h.view(num_tokens, width)
