"""The toy family (`ToyForCausalLM`): embeddings, then per layer x + toy(norm(x)) (tests/toy_mixer.py),
a final norm and an lm_head. Registered through the registry only (`registry.register`, which
its child processes inherit): no engine, cache, handover, wire or TP-planning file names it.

    config.json: vocab_size, hidden_size, num_hidden_layers, num_heads, head_dim,
                 peak_channels, decay, rms_norm_eps, chunk_size (+ the common keys)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.norm import RMSNorm
from baton.engine.models import registry
from baton.engine.parallel import TensorParallel
from tests.toy_mixer import ToyMixer, ToyMixerConfig, reference

ARCHITECTURE = "ToyForCausalLM"
HF_CONFIG_CLASS_PATH = "tests.toy_family.ToyHFConfig"


class ToyHFConfig:
    """What a missing key means (the role a transformers config class plays for the real
    families)."""

    def __init__(
        self,
        vocab_size: int = 64,
        hidden_size: int = 32,
        num_hidden_layers: int = 2,
        num_heads: int = 4,
        head_dim: int = 8,
        peak_channels: int = 4,
        decay: float = 0.5,
        rms_norm_eps: float = 1e-6,
        chunk_size: int = 8,
        tie_word_embeddings: bool = False,
        max_position_embeddings: int = 4096,
        eos_token_id: int = 0,
        bos_token_id: int | None = None,
    ):
        self.rope_parameters = None


@dataclass(frozen=True, kw_only=True, slots=True)
class ToyConfig:
    num_layers: int
    norm_eps: float
    mixer: ToyMixerConfig


def read_config(r: ConfigReader) -> ModelConfig:
    return ModelConfig(
        architecture=ARCHITECTURE,
        vocab_size=r.opt("vocab_size"),
        hidden_size=r.opt("hidden_size"),
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.opt("max_position_embeddings"),
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=ToyConfig(
            num_layers=r.opt("num_hidden_layers"),
            norm_eps=float(r.opt("rms_norm_eps")),
            mixer=ToyMixerConfig(
                num_heads=r.opt("num_heads"),
                head_dim=r.opt("head_dim"),
                peak_channels=r.opt("peak_channels"),
                decay=float(r.opt("decay")),
                chunk_size=r.opt("chunk_size"),
            ),
        ),
    )


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    toy = config.family
    return ModelStateSpec.of([ToyMixer.state_spec(toy.mixer, dtype)] * toy.num_layers)


def check_tp(config: ModelConfig, size: int) -> None:
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    parallel.split_evenly(config.family.mixer.num_heads, probe, "num_heads")


class ToyBlock(nn.Module):
    def __init__(self, hidden_size: int, config: ToyConfig, index: int):
        super().__init__()
        self.norm = RMSNorm(hidden_size, config.norm_eps)
        self.mixer = ToyMixer(hidden_size, config.mixer, index)

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        return hidden + self.mixer(self.norm(hidden), md, cache)


class ToyModel(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        toy = config.family
        self.embed = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            ToyBlock(config.hidden_size, toy, i) for i in range(toy.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, toy.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embed(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        return self.norm(hidden)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, ToyModel(config), "embed")


@torch.no_grad()
def reference_logits(model: Model, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of one whole sequence, every layer from its definition
    (tests/toy_mixer.py reference): the oracle of the engine runs."""
    backbone = model.model
    hidden = torch.nn.functional.embedding(torch.tensor(ids), backbone.embed.weight)
    for layer in backbone.layers:
        hidden = hidden + reference(layer.mixer, layer.norm(hidden))
    return model.lm_head(backbone.norm(hidden)).float()


registry.register(ARCHITECTURE, "toy", __name__)
