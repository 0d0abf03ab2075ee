"""LoRA-style adapters on a shared block's projections (Zamba2): the block's weights are stored
once and reused at several depths, and use `u` adds its own low-rank term to a projection,
`proj(x) + up_u(down_u(x))`. Adapters live in a list indexed by use, with an identity (no
parameters) for the uses another copy of the block owns, as transformers stores them
(`..._adapter_list.{u}.0.weight` down, `.1.weight` up)."""

from __future__ import annotations

import torch
from torch import nn


class AdapterList(nn.ModuleList):
    def __init__(self, in_features: int, out_features: int, rank: int, owned: list[bool]):
        """owned[u]: this block serves use u (else that slot is an identity)."""
        super().__init__(
            nn.Sequential(
                nn.Linear(in_features, rank, bias=False), nn.Linear(rank, out_features, bias=False)
            )
            if mine
            else nn.Identity()
            for mine in owned
        )

    def delta(self, use: int, x: torch.Tensor) -> torch.Tensor:
        """The adapter term of use `use` (transformers adds the identity's x for a use the block
        does not own; the model never routes such a use here)."""
        return self[use](x)
