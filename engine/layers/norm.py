"""RMSNorm as every family uses it (float32 math, the weight applied in float32 before the cast
back), and the zero-centred variant whose scale is (1 + weight)."""

from __future__ import annotations

import torch
from torch import nn

from baton.kernels.norm import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.weight_f32: torch.Tensor | None = None  # CPU: cached float32 copy (freeze)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight_f32 if self.weight_f32 is not None else self.weight
        return rms_norm(x, weight, self.eps)

    def freeze(self) -> None:
        self.weight_f32 = self.weight.detach().float().contiguous()


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose stored weight is centred on zero: the scale is (1 + w), applied in float32
    before the cast back (transformers' Qwen3NextRMSNorm / Gemma3RMSNorm; checkpoints store w,
    initialised to zeros)."""

    def __init__(self, hidden: int, eps: float):
        super().__init__(hidden, eps)
        with torch.no_grad():
            self.weight.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight_f32 if self.weight_f32 is not None else 1.0 + self.weight.float()
        return rms_norm(x, scale, self.eps)

    def freeze(self) -> None:
        self.weight_f32 = (1.0 + self.weight.detach().float()).contiguous()
