"""The multi-token-prediction (MTP) layer of the Bailing hybrid releases (Ling / Ring linear), as
SGLang's bailing_moe_nextn runs it for `bailing_hybrid` (the shared part: engine/layers/mtp.py):

    x   = eh_proj(cat(enorm(embed(token_{p+1})), hnorm(h_p)))     embedding first; no bias
    x   = a Bailing decoder layer over x: MLA (its own latent pages, rotary at position p),
          then the MoE (the dense MLP when the model has no experts), pre-norm and residual each
    out = final_layernorm(x)                                       the next hidden state

Plain RMSNorms, as the family's own. transformers builds no MTP layer (it ignores the tensors),
so the reference in the tests is transformers' decoder layer and norms over the same tensors.

Weights as the releases store them, after the decoder at `model.layers.{num_hidden_layers}.`:
`{enorm, hnorm, eh_proj, final_layernorm}` and the decoder layer's own names (`attention.*`,
`mlp.*`, `input_layernorm`, `post_attention_layernorm`); `checkpoint_renamer` reads them into
`mtp.*` (skipped, with one log line, when speculation does not draft with them).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from baton.engine.cache.pools import StateCache
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.norm import RMSNorm

# the MTP layer's own tensors; the others are its decoder layer's
FUSE_NAMES = ("enorm", "hnorm", "eh_proj", "final_layernorm")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


class BailingMTP(nn.Module):
    def __init__(self, hidden_size: int, eps: float, layer: nn.Module):
        """layer: the family's MLA decoder layer, its latent pages after the model's own."""
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = nn.ModuleList([layer])
        self.final_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self, embeds: torch.Tensor, prev_hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache
    ) -> torch.Tensor:
        fused = torch.cat([self.enorm(embeds), self.hnorm(prev_hidden)], dim=-1)
        return self.final_layernorm(self.layers[0](self.eh_proj(fused), md, cache))


def mtp_renamer(
    num_layers: int, rename: Callable[[str], str | None]
) -> Callable[[str], str | None]:
    """A checkpoint renamer: the MTP layers stored after the decoder's `num_layers` as `mtp.*`
    (layer num_layers + j -> mtp.layers.j, its fuse tensors at the top of `mtp.`), every name
    then through the family's `rename`."""

    def renamed(name: str) -> str | None:
        match = _LAYER.match(name)
        if match is not None and int(match[1]) >= num_layers:
            j, rest = int(match[1]) - num_layers, match[2]
            if rest.split(".", 1)[0] in FUSE_NAMES:
                return f"mtp.{rest}" if j == 0 else f"mtp.extra.{j}.{rest}"
            name = f"mtp.layers.{j}.{rest}"
        return rename(name)

    return renamed
