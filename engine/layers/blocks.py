"""The two-step decoder layer of Bamba / Granite-4.0-H / Falcon-H1-like families:

    h = h + m * mixer(norm_1(h))       mixer: Mamba2 or attention (reads/writes the pools)
    h = h + m * sum(ffn(norm_2(h)))    ffn: one or more row-wise modules side by side (a dense
                                       MLP; Granite's MoE + shared MLP), outputs summed

with `m` the residual multiplier (Granite's µP; 1.0 elsewhere). The family passes the module
names its checkpoints use, so weights load by name.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.cache.pools import StateCache
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.norm import RMSNorm


class MixerFFNLayer(nn.Module):
    def __init__(
        self,
        *,
        names: tuple[str, str, str],  # (norm_1, mixer, norm_2) attribute names
        hidden_size: int,
        eps: float,
        mixer: nn.Module,
        ffn: dict[str, nn.Module],  # attribute name -> row-wise module
        residual_multiplier: float,
        norm: type[RMSNorm] = RMSNorm,  # ZeroCenteredRMSNorm for the Qwen gated DeltaNet hybrids
    ):
        super().__init__()
        self.names = names
        self.add_module(names[0], norm(hidden_size, eps))
        self.add_module(names[1], mixer)
        self.add_module(names[2], norm(hidden_size, eps))
        for name, module in ffn.items():
            self.add_module(name, module)
        self.ffn_names = tuple(ffn)
        self.residual_multiplier = residual_multiplier

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        norm_1, mixer, norm_2 = (getattr(self, n) for n in self.names)
        m = self.residual_multiplier
        out = mixer(norm_1(hidden), md, cache)
        hidden = hidden + (out if m == 1.0 else out * m)
        normed = norm_2(hidden)
        out = getattr(self, self.ffn_names[0])(normed)
        for name in self.ffn_names[1:]:
            out = out + getattr(self, name)(normed)
        return hidden + (out if m == 1.0 else out * m)
