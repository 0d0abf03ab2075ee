"""Runs one scheduled batch through the model: build metadata (the one builder), forward."""

from __future__ import annotations

import torch

from engine.forward_metadata import Mamba2Metadata, ScheduledBatch, build_metadata
from engine.layers.causal_lm import CausalLM
from engine.state_cache import StateCache


class ModelRunner:
    def __init__(self, model: CausalLM, cache: StateCache, device: torch.device | str):
        self.model = model
        self.cache = cache
        self.device = device
        self.config = model.config

    def build(self, sched: ScheduledBatch) -> Mamba2Metadata:
        return build_metadata(
            sched,
            page_size=self.cache.page_size,
            chunk_size=self.config.chunk_size,
            conv_kernel=self.config.conv_kernel,
            device=self.device,
            kv_capacity=None,
            track_capacity=None,
        )

    @torch.inference_mode()
    def forward(self, sched: ScheduledBatch) -> tuple[Mamba2Metadata, torch.Tensor]:
        """Returns the metadata and float32 logits for its `logits_indices` rows."""
        md = self.build(sched)
        return md, self.model(md, self.cache)
