"""RMSNorm as every family uses it (float32 math, weight applied after casting back)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.norm import rms_norm


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
