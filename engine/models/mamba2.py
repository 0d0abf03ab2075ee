"""Mamba2 (`Mamba2ForCausalLM`, state-spaces; Mistral's Mamba-Codestral): a pure state-space model,
every layer pre-RMSNorm -> the shared Mamba2 mixer (engine/layers/mamba2.py: SSD scan, gated
RMSNorm over groups of intermediate / n_groups) -> residual, float32 residual stream when
`residual_in_fp32`. Its state is the Mamba2 conv window and SSM state: no K/V pool, no pages.
Weight names as Mamba's (engine/models/mamba.py): `backbone.` on disk, `model.` in memory.
"""

from __future__ import annotations

import torch

from baton.engine import parallel
from baton.engine.cache.spec import ModelStateSpec
from baton.engine.config import ConfigReader, ModelConfig
from baton.engine.layers.causal_lm import CausalLM
from baton.engine.layers.mamba2 import Mamba2Config, Mamba2Mixer, mamba_shard
from baton.engine.models.mamba import SSMBackbone, checkpoint_name, read_ssm
from baton.engine.parallel import TensorParallel

__all__ = [
    "HF_CONFIG_CLASS_PATH",
    "Model",
    "check_tp",
    "checkpoint_name",
    "read_config",
    "state_spec",
]

HF_CONFIG_CLASS_PATH = "transformers.models.mamba2.configuration_mamba2.Mamba2Config"


def read_config(r: ConfigReader) -> ModelConfig:
    hidden, heads, head_dim = r.need("hidden_size"), r.opt("num_heads"), r.opt("head_dim")
    intermediate = int(r.opt("expand") * hidden)
    if heads * head_dim != intermediate:  # transformers' validate_architecture
        raise r.error(
            f"num_heads={heads} x head_dim={head_dim} must equal expand x hidden_size="
            f"{intermediate}"
        )
    r.require("hidden_act", ("silu",))
    r.require_multiple("num_heads", heads, "n_groups", r.opt("n_groups"))
    bias = bool(r.opt("use_bias"))
    eps = float(r.opt("layer_norm_epsilon"))
    mixer = Mamba2Config(
        num_heads=heads,
        head_dim=head_dim,
        state_size=r.opt("state_size"),
        n_groups=r.opt("n_groups"),
        conv_kernel=r.opt("conv_kernel"),
        chunk_size=r.opt("chunk_size"),
        conv_bias=bool(r.opt("use_conv_bias")),
        proj_bias=bias,
        out_proj_bias=bias,
        time_step_limit=r.time_step_limit(),
        norm="gated",  # transformers' Mamba2 always gates (a file's `rms_norm` is read by nothing)
        norm_eps=eps,
        cache_dtype="float32",
        in_multiplier=1.0,
        multipliers=(1.0,) * 5,
    )
    return read_ssm(r, "Mamba2ForCausalLM", mixer)


def state_spec(config: ModelConfig, dtype: torch.dtype) -> ModelStateSpec:
    """A Mamba2 conv window and SSM state per layer."""
    ssm = config.family
    return ModelStateSpec.of([Mamba2Mixer.state_spec(ssm.mixer, dtype)] * ssm.num_layers)


def check_tp(config: ModelConfig, size: int) -> None:
    probe = TensorParallel(rank=0, size=size, group=None, timeout_s=0.0)
    mixer = config.family.mixer
    parallel.split_evenly(mixer.num_heads, probe, "num_heads")  # (this family's name for it)
    mamba_shard(mixer, probe)


class Model(CausalLM):
    def __init__(self, config: ModelConfig):
        super().__init__(config, SSMBackbone(config, Mamba2Mixer), "embeddings")
