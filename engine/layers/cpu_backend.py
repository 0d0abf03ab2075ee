"""The CPU backend step, applied once after loading to any model built from the shared layers
(never inside a family's forward):

1. layers that know a better CPU form repack themselves (`pack_for_cpu`: q/k/v fused into one
   prepacked matmul, relu fused into an up projection, gate/up fused, MoE experts reordered);
2. every remaining `nn.Linear` becomes a oneDNN-prepacked `PackedLinear` (kernels/linear.py):
   decode's few-row matmuls, lm_head above all, run 1.2-3x faster than F.linear;
3. layers that cache float32 forms of small parameters for the C kernels (`freeze`: the Mamba
   mixer's fused decode step, norms) take them now that the weights are final.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.linear import can_pack, pack_linears


def prepare_for_cpu(model: nn.Module, dtype: torch.dtype) -> None:
    """Call after the weights are loaded and cast; the plain linear weights are dropped."""
    if can_pack(dtype):
        for module in list(model.modules()):
            if hasattr(module, "pack_for_cpu"):
                module.pack_for_cpu()
    pack_linears(model, dtype)
    for module in model.modules():
        if hasattr(module, "freeze"):
            module.freeze()
