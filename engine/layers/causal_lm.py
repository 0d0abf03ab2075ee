"""What every family's `...ForCausalLM` shares: a backbone that maps the batch to final hidden
states, an lm_head (tied to the embeddings or not), logits for the sampled rows only."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.forward_metadata import Mamba2Metadata
from engine.state_cache import StateCache


class CausalLM(nn.Module):
    """`self.model` is the family's backbone (`forward(md, cache) -> hidden`, with its token
    embedding at `self.model.<embedding_name>`)."""

    def __init__(self, config: ModelConfig, backbone: nn.Module, embedding_name: str):
        super().__init__()
        self.config = config
        self.model = backbone
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tied_parameters: tuple[str, ...] = ()
        if config.tie_word_embeddings:
            self.lm_head.weight = getattr(self.model, embedding_name).weight
            self.tied_parameters = ("lm_head.weight",)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        """Returns float32 logits for the rows `md.forward.batch.logits_indices`."""
        hidden = self.model(md, cache)
        logits = self.lm_head(hidden[md.forward.batch.logits_indices])
        # In the model dtype, as transformers: Granite divides, Falcon-H1 multiplies.
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        if self.config.lm_head_multiplier != 1.0:
            logits = logits * self.config.lm_head_multiplier
        return logits.float()
