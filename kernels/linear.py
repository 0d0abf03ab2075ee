"""CPU linear layers on weights prepacked once into oneDNN's blocked layout.

`F.linear` on the CPU repacks the weight on every call; for the few-row matmuls of decode (and
the wide lm_head) that repacking costs more than the multiply. Reordering the weight once at load
time (`torch.ops.mkldnn._reorder_linear_weight`) and calling `_linear_pointwise` runs 1.2-3x
faster on this project's shapes (bench numbers in the engine issue's note), with the same
float32 accumulation. `pack_linears` swaps every `nn.Linear` of a model for a `PackedLinear`;
dtypes oneDNN cannot run on this CPU keep `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return False


class PackedLinear(nn.Module):
    """`y = x @ W.T + b` with W held only in oneDNN's layout (the plain copy is dropped)."""

    def __init__(self, linear: nn.Linear, activation: str = "none"):
        """activation: oneDNN post-op fused into the matmul ("none" or "relu")."""
        super().__init__()
        if activation not in ("none", "relu"):
            raise ValueError(f"unsupported fused activation {activation!r}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.activation = activation
        weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, self.activation, [], ""
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"activation={self.activation}, packed"
        )


def pack_linears(model: nn.Module, dtype: torch.dtype) -> int:
    """Replace each `nn.Linear` under `model` by a PackedLinear; returns how many were packed."""
    if not can_pack(dtype):
        return 0
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear and child.weight.device.type == "cpu"
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


def matmul_params(model: nn.Module) -> int:
    """Weights that take part in a matmul per token (linear layers, packed or not)."""
    return sum(
        m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, (nn.Linear, PackedLinear))
    )
