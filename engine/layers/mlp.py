"""Dense MLPs (NemotronH's up/down with relu², also its MoE's shared expert)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.linear import PackedLinear


class ReluSquaredMLP(nn.Module):
    """down_proj(relu(up_proj(x))²): NemotronH's `mlp` block and its MoE's shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = self.up_proj(x)
        if getattr(self.up_proj, "activation", "none") != "relu":
            up = torch.relu(up)
        return self.down_proj(up.square())

    def pack_for_cpu(self) -> None:
        """relu fused into the up projection's packed matmul (kernels/linear.py)."""
        self.up_proj = PackedLinear(self.up_proj, activation="relu")
