"""The multi-token-prediction (MTP) layer of the Qwen gated DeltaNet hybrids (Qwen3-Next,
Qwen3.5 dense and MoE), as vLLM's qwen3_next_mtp / qwen3_5_mtp and SGLang run it (the shared
part: engine/layers/mtp.py):

    x   = fc(cat(pre_fc_norm_embedding(embed(token_{p+1})), pre_fc_norm_hidden(h_p)))
                                        embedding first; fc (2 hidden -> hidden), no bias
    x   = the family's decoder layer over x: gated attention (its own K/V, rotary at position
          p), then the family's MLP or MoE, pre-norm and residual each
    out = norm(x)                       the next hidden state; lm_head(out) drafts token p + 2

Every norm is zero-centred (1 + w), as the family's own. h_p is the target's final hidden state
(after its `norm`). Weights `mtp.{pre_fc_norm_embedding, pre_fc_norm_hidden, fc, layers.0.*,
norm}` at the top level of the checkpoint, also in the vision checkpoints (beside
`model.language_model.`); the embedding and lm_head are the model's. One layer, chained for
every draft (vLLM: draft step t runs layer t mod mtp_num_hidden_layers).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.cache.pools import StateCache
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.norm import ZeroCenteredRMSNorm


class QwenMTP(nn.Module):
    def __init__(self, hidden_size: int, eps: float, layer: nn.Module):
        """layer: the family's full-attention decoder layer, its K/V in the pool after the
        model's own attention layers."""
        super().__init__()
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden_size, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden_size, eps)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = ZeroCenteredRMSNorm(hidden_size, eps)

    def forward(
        self, embeds: torch.Tensor, prev_hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache
    ) -> torch.Tensor:
        fused = torch.cat(
            [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(prev_hidden)], dim=-1
        )
        return self.norm(self.layers[0](self.fc(fused), md, cache))
