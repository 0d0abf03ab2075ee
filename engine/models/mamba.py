"""Mamba (`MambaForCausalLM`, state-spaces): a pure state-space model, no attention. Every layer is
pre-RMSNorm -> a Mamba1 mixer (engine/layers/mamba1.py) -> residual; the residual stream stays
float32 when `residual_in_fp32` (transformers' MambaBlock). Its state is the conv window and the
SSM state per slot: no K/V pool, no pages.

Weights: `backbone.` on disk, `model.` in memory (`checkpoint_name`; the oldest files say
`backbone.embedding`); `model.embeddings`, `model.layers.{i}.norm`, `model.layers.{i}.mixer.*`,
`model.norm_f`; lm_head tied to the embeddings by default.

The pure-SSM pieces here (block, backbone, names) serve Falcon-Mamba and Mamba2 too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.cache.spec import ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.executor.forward_metadata import Mamba2Metadata
from baton.engine.layers.causal_lm import CausalLM, VocabParallelEmbedding
from baton.engine.layers.mamba1 import MAMBA1_CHUNK_SIZE, BCDtNorm, Mamba1Config, Mamba1Mixer
from baton.engine.layers.norm import RMSNorm
from baton.engine.parallel import TensorParallel

HF_CONFIG_CLASS_PATH = "transformers.models.mamba.configuration_mamba.MambaConfig"

# A pure SSM's config names no context length; like vLLM, assume 2048 (`--max-model-len` sets
# another: the state does not grow with it).
DEFAULT_MAX_LENGTH = 2048


@dataclass(frozen=True, kw_only=True, slots=True)
class SSMConfig:
    """A stack of `num_layers` norm -> mixer -> residual blocks."""

    num_layers: int
    norm_eps: float
    residual_in_fp32: bool
    mixer: Any  # Mamba1Config (Mamba, Falcon-Mamba) or Mamba2Config (Mamba2)


def checkpoint_name(name: str) -> str:
    """`backbone.` on disk, `model.` in memory; the oldest files' `embedding.` is `embeddings.`
    (transformers' MambaModel load hook)."""
    if name.startswith("backbone."):
        name = "model." + name[len("backbone.") :]
    if name == "model.embedding.weight":
        return "model.embeddings.weight"
    return name


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """A Mamba1 conv window and SSM state per layer."""
    ssm = config.family
    return ModelStateSpec.of([Mamba1Mixer.state_spec(ssm.mixer, dtype)] * ssm.num_layers)


def check_tp(config: ModelConfig, size: int) -> None:
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    mixer = config.family.mixer
    parallel.split_evenly(mixer.intermediate, probe, mixer.what)


def read_mamba1(r: ConfigReader, bcdt_norm: BCDtNorm, norm_eps_key: str) -> Mamba1Config:
    """The mixer keys MambaConfig and FalconMambaConfig share (`norm_eps_key`: the eps of the
    dt/B/C norms, Falcon-Mamba's `mixer_rms_eps`)."""
    hidden = r.need("hidden_size")
    r.require("hidden_act", ("silu",))
    rank = r.opt("time_step_rank")
    return Mamba1Config(
        # transformers sets expand x hidden_size first, then lets a stored `intermediate_size`
        # override it (falcon-mamba-7b says expand 16 and intermediate_size 8192: 8192 it is)
        intermediate=int(r.hf.get("intermediate_size") or r.opt("expand") * hidden),
        state_size=r.opt("state_size"),
        conv_kernel=r.opt("conv_kernel"),
        dt_rank=math.ceil(hidden / 16) if rank == "auto" else int(rank),
        conv_bias=bool(r.opt("use_conv_bias")),
        proj_bias=bool(r.opt("use_bias")),
        bcdt_norm=bcdt_norm,
        norm_eps=float(r.opt(norm_eps_key)),
        chunk_size=MAMBA1_CHUNK_SIZE,
        cache_dtype="float32",
        what="intermediate_size (expand x hidden_size)",
    )


def read_ssm(r: ConfigReader, architecture: str, mixer: Any) -> ModelConfig:
    """ModelConfig of a pure SSM with the given mixer config (the keys the three share)."""
    return ModelConfig(
        architecture=architecture,
        vocab_size=r.need("vocab_size"),
        hidden_size=r.need("hidden_size"),
        tie_word_embeddings=bool(r.opt("tie_word_embeddings")),
        max_position_embeddings=r.hf.get("max_position_embeddings") or DEFAULT_MAX_LENGTH,
        num_nextn_predict_layers=0,
        eos_token_ids=r.eos_token_ids(),
        bos_token_id=r.opt("bos_token_id"),
        torch_dtype=r.torch_dtype(),
        family=SSMConfig(
            num_layers=r.need("num_hidden_layers"),
            norm_eps=float(r.opt("layer_norm_epsilon")),
            residual_in_fp32=bool(r.opt("residual_in_fp32")),
            mixer=mixer,
        ),
    )


def read_config(r: ConfigReader) -> ModelConfig:
    return read_ssm(r, "MambaForCausalLM", read_mamba1(r, "none", "layer_norm_epsilon"))


class SSMBlock(nn.Module):
    """h + mixer(norm(h)); with residual_in_fp32 the sum (the residual stream) is float32 and
    the norm reads it in the model dtype, as transformers' MambaBlock."""

    def __init__(self, hidden_size: int, config: SSMConfig, mixer: nn.Module):
        super().__init__()
        self.norm = RMSNorm(hidden_size, config.norm_eps)
        self.mixer = mixer
        self.residual_in_fp32 = config.residual_in_fp32

    def forward(self, hidden: torch.Tensor, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        dtype = self.norm.weight.dtype
        out = self.mixer(self.norm(hidden.to(dtype)), md, cache)
        return (hidden.float() if self.residual_in_fp32 else hidden) + out


class SSMBackbone(nn.Module):
    def __init__(self, config: ModelConfig, mixer_for):
        """mixer_for(hidden_size, mixer config, layer index) -> the layer's mixer."""
        super().__init__()
        ssm = config.family
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            SSMBlock(config.hidden_size, ssm, mixer_for(config.hidden_size, ssm.mixer, i))
            for i in range(ssm.num_layers)
        )
        self.norm_f = RMSNorm(config.hidden_size, ssm.norm_eps)

    def forward(self, md: Mamba2Metadata, cache: StateCache) -> torch.Tensor:
        hidden = self.embeddings(md.forward.batch.input_ids)
        for layer in self.layers:
            hidden = layer(hidden, md, cache)
        # the float32 residual stream goes to lm_head in the model dtype, as transformers casts it
        return self.norm_f(hidden).to(self.norm_f.weight.dtype)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, SSMBackbone(config, Mamba1Mixer), "embeddings")
